"""The step-cost tool measures every requested step size and leaves the cache as it found it."""
from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime.runner import ModelRunner
from lab.stepcost import step_costs


def test_step_costs_shape_and_cache_untouched():
    target, _ = tiny_pair(tiny_spec(vocab_size=128), seed=0)
    runner = ModelRunner.alone(TorchEngine(target), 128)
    rows = step_costs(runner, [1, 2, 8], cached=32, repeats=2)
    assert [r["T"] for r in rows] == [1, 2, 8]
    assert all(0 < r["min_s"] <= r["median_s"] for r in rows)
    assert runner.cache.length == 32 and runner.cache.scratch == 0


def test_ort_profile_per_op_type(tmp_path):
    """`stepcost --profile`: ORT's own trace, summed per op type for each T; its runs are the timed steps."""
    import json

    from click.testing import CliRunner

    from trtspec.assembly.config import load_config
    from trtspec.assembly.build import build_engines
    from lab.ort_profile import op_times
    from lab.stepcost import main

    cfg = load_config("tiny-random").with_backend("onnxruntime")
    folder = build_engines(cfg, tmp_path / "e", log=lambda *a, **k: None)
    res = CliRunner().invoke(main, ["--engines", str(folder), "--tokens", "1,8", "--cached", "16",
                                    "--repeats", "2", "--profile", str(tmp_path / "prof")])
    assert res.exit_code == 0, res.output
    rows = [json.loads(l) for l in res.output.splitlines() if l.startswith("{")]
    assert [r["T"] for r in rows] == [1, 8] and rows[0]["backend"] == "onnxruntime"
    assert "| MatMul |" in res.output and "| whole step |" in res.output
    (trace,) = (tmp_path / "prof").glob("target_*.json")
    prof = op_times(trace, [1, 8], 2)
    for t in (1, 8):      # node time sits inside the step's wall time
        assert 0 < sum(prof[t]["ops"].values()) <= prof[t]["step_ms"]
    torch_folder = build_engines(load_config("tiny-random"), tmp_path / "t", log=lambda *a, **k: None)
    bad = CliRunner().invoke(main, ["--engines", str(torch_folder), "--profile", str(tmp_path / "p2")])
    assert bad.exit_code == 2 and "profiles are ONNX Runtime's; this run uses backend torch" in bad.output
    # --against: both folders' forwards interleaved in one process, one row per folder and T
    res = CliRunner().invoke(main, ["--engines", str(folder), "--against", str(torch_folder), "--role", "draft",
                                    "--tokens", "1,4", "--cached", "8", "--repeats", "2"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(l) for l in res.output.splitlines() if l.startswith("{")]
    assert [(r["engines"], r["T"]) for r in rows] == [(str(folder), 1), (str(torch_folder), 1),
                                                      (str(folder), 4), (str(torch_folder), 4)]
    assert all(0 < r["min_s"] <= r["median_s"] for r in rows)
