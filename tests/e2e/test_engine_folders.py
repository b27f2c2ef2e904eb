"""Engine folders: a folder runs the backend it was built for (an override without artifacts is
refused with the rebuild command), what a build writes (no TensorRT unless asked, the loaders' eos
ids, the newest opset), and limits checked against the model (max_seq_len).
"""
from __future__ import annotations


import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import QUIET, TINY, one_line_error, tiny_dict, write_config
from trtspec.cli import main
from trtspec.assembly.config import MAX_OPSET, load_config
from trtspec.assembly.build import build_engines
from trtspec.assembly.load import load_generator
from trtspec.engines.manifest import EngineError, verify

# ---------------------------------------------------------------------------------------------
# Engine folders: the backend they were built for, what a build writes
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ort_folder(tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("hard") / "ort"
    lines: list[str] = []
    build_engines(load_config(TINY), out, backend="onnxruntime", log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return out, lines




def test_run_uses_the_folders_backend(ort_folder, torch_folder):
    folder, _ = ort_folder
    assert verify(folder)["backend"] == "onnxruntime"
    for eng, want in ((folder, "onnxruntime"), (torch_folder, "torch")):
        res = CliRunner().invoke(main, ["run", "--engines", str(eng), "--prompt", "x = 1", "--max-new-tokens", "4",
                                        "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output.strip().splitlines()[-1])["backend"] == want


def test_backend_without_artifacts_is_refused_with_the_rebuild_command(torch_folder, ort_folder):
    res = CliRunner().invoke(main, ["run", "--engines", str(torch_folder), "--prompt", "x", "--backend",
                                    "onnxruntime"])
    line = one_line_error(res)
    assert "built for torch" in line and "--backend onnxruntime --force" in line and "trtspec build" in line
    # An ONNX Runtime folder holds its weights once, as the optimized graph: no torch weights either.
    res = CliRunner().invoke(main, ["run", "--engines", str(ort_folder[0]), "--prompt", "x", "--backend", "torch"])
    line = one_line_error(res)
    assert "built for onnxruntime" in line and "--backend torch --force" in line


def test_onnxruntime_build_says_nothing_about_tensorrt(ort_folder):
    folder, lines = ort_folder
    assert not any("TensorRT" in line for line in lines), lines
    assert not [k for k in verify(folder)["models"]["target"]["artifacts"] if k.startswith("plan_")]


def test_tensorrt_build_refused_up_front_here(tmp_path):
    from trtspec.engines.tensorrt_build import tensorrt_unavailable_reason
    if tensorrt_unavailable_reason() is None:
        pytest.skip("TensorRT and a GPU are present here")
    with pytest.raises(EngineError, match="cannot build for backend tensorrt here"):
        build_engines(load_config(TINY), tmp_path / "trt", backend="tensorrt", **QUIET)
    assert not list(tmp_path.iterdir())


def test_loaders_eos_ids_reach_the_manifest(tmp_path, monkeypatch):
    import trtspec.assembly.build as build_mod
    real = build_mod.open_source

    def with_eos(entry, role):
        weights = real(entry, role)
        weights.spec.extra["eos_token_ids"] = [7, 11]
        return weights
    monkeypatch.setattr(build_mod, "open_source", with_eos)
    out = build_engines(load_config(TINY), tmp_path / "eos", backend="torch", **QUIET)
    assert {7, 11} <= set(verify(out)["stop_ids"])
    assert {7, 11} <= load_generator(out).stop_ids


def test_max_seq_len_beyond_the_model_is_refused(tmp_path):
    d = tiny_dict()
    d["max_seq_len"] = 8192        # the tiny model has 4096 positions
    with pytest.raises(EngineError, match="max_seq_len 8192 is longer than target"):
        build_engines(load_config(write_config(tmp_path, d)), tmp_path / "out", backend="torch", **QUIET)
    assert not (tmp_path / "out").exists()


def test_newest_accepted_opset_builds_and_runs(tmp_path):
    d = tiny_dict()
    d["build"] = {"onnx_dtypes": ["fp32"], "opset": MAX_OPSET}
    d["backend"] = "onnxruntime"
    cfg = load_config(write_config(tmp_path, d))
    gen = load_generator(build_engines(cfg, tmp_path / "op", **QUIET))
    assert gen.backend == "onnxruntime"
    ref = load_generator(build_engines(cfg, tmp_path / "ref", backend="torch", **QUIET))
    prompt = [5, 6, 7]
    assert gen.generate(prompt, max_new_tokens=8).token_ids == ref.generate(prompt, max_new_tokens=8).token_ids
