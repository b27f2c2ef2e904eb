"""Configs and options are refused before work starts, in one line that names the key and the fix:
every section and every strategy's options at load, the checks `trtspec run` makes before engines
are built or loaded, sampling settings; only the project's errors become one line (a bug keeps its
traceback).
"""
from __future__ import annotations

import copy

import math

import pytest
from click.testing import CliRunner

from conftest import TINY, one_line_error, tiny_dict, write_config
from trtspec.cli import main
from trtspec.assembly.config import MAX_OPSET, Config, ConfigError, load_config
from trtspec.errors import RequestError, TrtspecError
from trtspec.runtime.generator import Generator
from trtspec.runtime.kv_cache import CapacityError
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import GSD, ChainSpeculative, DySpec, make_strategy

# ---------------------------------------------------------------------------------------------
# Config validation at load
# ---------------------------------------------------------------------------------------------

def _set(d: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = d
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return d


@pytest.mark.parametrize("path, value, words", [
    ("strategies.dyspec", {"batch": 0}, ["strategies.dyspec.batch", "0", "greater than or equal to 1"]),
    ("strategies.gsd", {"top_k": 0}, ["strategies.gsd.top_k", "0", "greater than or equal to 1"]),
    ("strategies.cascade", {"k_draft": 0}, ["strategies.cascade.k_draft", "0"]),
    ("strategies.chian", {"k": 4}, ["'chian'", "chain"]),
    ("strategies.chain", {"kk": 4}, ["strategies.chain.kk", "unknown key", "allowed: k"]),
    ("strategies.ngram", {"k": "8"}, ["strategies.ngram.k", "'8'", "integer"]),
    ("strategies.staged", {"stage2": 1}, ["strategies.staged.stage2", "boolean"]),
    ("strategies.dyspec", {"threshold": math.nan}, ["strategies.dyspec.threshold", "nan", "finite"]),
    ("strategies.dyspec", {"variant": "tree"}, ["strategies.dyspec.variant", "heap", "threshold"]),
    ("strategies.ar", {"k": 1}, ["strategies.ar.k", "unknown key"]),
    ("strategies.chain", {"k": 300}, ["strategies.chain.k", "300", "'auto' or an integer in 1..255"]),
    ("strategy", "turbo", ["'turbo'", "ar, chain"]),
    ("target.quant", "int8", ["target.quant", "unknown key", "allowed: model, dtype"]),
    ("target.quantize", "int8", ["target.quantize: int8", "does not quantize targets", "backend onnxruntime"]),
    ("draft.quantize", "int4", ["draft.quantize: int4", "no int4 kernels", "int8"]),
    ("target.attention", "logical", ["target.attention: logical", "onnxruntime target", "activations: int8"]),
    ("target.attention", "fp32", ["target.attention", "'fp32'", "fp64", "logical"]),
    ("build.opset", 17, ["build.opset", "17", "greater than or equal to 18"]),
    ("build.opset", MAX_OPSET + 1, ["build.opset", "less than or equal to"]),
    ("build.optimise", True, ["build.optimise", "unknown key", "optimize"]),
    ("build.onnx_dtypes", ["fp8"], ["build.onnx_dtypes.0", "'fp8'", "fp32"]),
    ("threads", -1, ["threads", "-1", "greater than or equal to 0"]),
    ("max_seq_len", 8, ["max_seq_len", "8"]),
    ("name", "../evil", ["name", "'../evil'", "pattern"]),
    ("backend", "tensorflow", ["backend", "'tensorflow'", "torch"]),
    ("buckets.tokens", [0], ["buckets.tokens.0", "0"]),
    ("target.tiny.num_layers", 10_000, ["target.tiny.num_layers", "10000"]),
    ("target.model", "tiny:x", ["target.model", "tiny:SEED"]),
    ("strategies.cascade", {"bigram": "/nonexistent.npy"}, ["strategies.cascade.bigram", "/nonexistent.npy"]),
])
def test_bad_config_is_one_line_naming_key_and_value(tmp_path, path, value, words):
    bad = write_config(tmp_path, _set(tiny_dict(), path, value))
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


def test_quantize_options_per_backend(tmp_path):
    d = _set(tiny_dict(), "draft.quantize", "int8")
    torch_cfg = load_config(write_config(tmp_path, d))
    assert torch_cfg.draft.quantize == "int8"                                         # torch: applied at load
    d = _set(_set(d, "target.quantize", "int4"), "backend", "onnxruntime")           # onnxruntime: built in
    ort_cfg = load_config(write_config(tmp_path, d))
    assert (ort_cfg.target.quantize, ort_cfg.draft.quantize) == ("int4", "int8")
    # The quantized graph is a build input: it names another engine folder; torch's load-time int8 does not.
    plain = load_config(write_config(tmp_path, _set(copy.deepcopy(d), "target.quantize", "none")))
    assert ort_cfg.digest() != plain.digest()
    assert torch_cfg.digest() == load_config(write_config(tmp_path, tiny_dict())).digest()
    for key, value, words in (("backend", "tensorrt", "never ran here"),
                              ("target.dtype", "fp16", "set target.dtype fp32"),
                              ("target.quantize", "int8", "set target.activations int8"),
                              ("target.quantize", "gguf", "tiny:0 is not one"),
                              ("device", "cuda", "quantized engines run on CPU")):
        with pytest.raises(ConfigError, match=words):
            load_config(write_config(tmp_path, _set(copy.deepcopy(d), key, value)))


def test_activations_options(tmp_path):
    """`activations:` belongs to ONNX Runtime's quantized MatMuls, and an int8 target needs it at int8;
    it names another engine folder."""
    d = _set(_set(_set(tiny_dict(), "backend", "onnxruntime"), "target.quantize", "int4"), "draft.quantize", "int8")
    auto = load_config(write_config(tmp_path, d))
    assert auto.target.activations == "auto"
    int8 = load_config(write_config(tmp_path, _set(copy.deepcopy(d), "target.activations", "int8")))
    assert int8.digest() != auto.digest()
    load_config(write_config(tmp_path, _set(_set(copy.deepcopy(d), "target.activations", "int8"),
                                            "target.quantize", "int8")))      # int8 weights: with int8 activations
    for key, value, words in (("target.quantize", "none", "target.activations: int8: .*quantize int4 or gguf"),
                              ("backend", "torch", "target.activations: int8: .*backend onnxruntime")):
        bad = _set(_set(copy.deepcopy(d), "target.activations", "int8"), key, value)
        if key == "backend":
            bad = _set(_set(bad, "target.quantize", "none"), "draft.quantize", "int8")
        with pytest.raises(ConfigError, match=words):
            load_config(write_config(tmp_path, bad))


def test_attention_auto_names_the_logical_build(tmp_path, monkeypatch):
    """An int8-activation target's `attention: auto` is attention by logical order: the same engine
    folder as `attention: logical`, neither the one of `attention: fp64` nor the one `auto` named when
    it meant fp64 (its digest left the key out, as it still does where no exact attention applies)."""
    from trtspec.engines import quantize
    d = _set(_set(_set(_set(tiny_dict(), "backend", "onnxruntime"), "target.quantize", "int4"),
                  "draft.quantize", "int8"), "target.activations", "int8")
    cfg = {a: load_config(write_config(tmp_path, _set(copy.deepcopy(d), "target.attention", a)))
           for a in ("auto", "logical", "fp64")}
    digest = {a: c.digest() for a, c in cfg.items()}
    assert digest["auto"] == digest["logical"] != digest["fp64"]
    monkeypatch.setattr(quantize, "exact_attention", lambda role, entry: "")
    assert cfg["auto"].digest() not in digest.values()            # the key left out: the folder of before


def test_tree_too_big_for_the_kv_capacity_is_refused_at_load(tmp_path):
    d = _set(tiny_dict(), "strategies.gsd", {"max_draft_nodes": 200, "budget": 8})
    d["max_seq_len"] = 64
    with pytest.raises(ConfigError, match=r"strategies.gsd: one step can need 200 KV rows.*max_seq_len 64"):
        load_config(write_config(tmp_path, d))


def test_step_over_the_step_limit_is_refused_at_load(tmp_path):
    d = _set(tiny_dict(), "strategies.staged", {"budget": 200, "max_rounds": 8, "stage2_len": 10})
    d["max_seq_len"] = 1024
    with pytest.raises(ConfigError, match=r"strategies.staged: one step can send 281 tokens.*256"):
        load_config(write_config(tmp_path, d))


def test_a_strategy_that_fits_max_seq_len_leaves_room_for_a_token(tmp_path):
    d = _set(tiny_dict(), "strategies.ngram", {"k": 14})       # 15 rows: 1 prompt + 1 new + 15 > 16
    d["max_seq_len"] = 16
    with pytest.raises(ConfigError, match="strategies.ngram: one step can need 15 KV rows"):
        load_config(write_config(tmp_path, d))
    d["strategies"]["ngram"]["k"] = 13                          # 1 + 1 + 14 = 16: fits
    load_config(write_config(tmp_path, d))


def test_a_backend_override_is_checked_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    d = tiny_dict()
    d["build"] = {"onnx_dtypes": ["bf16"]}
    cfg = write_config(tmp_path, d)
    res = CliRunner().invoke(main, ["run", "--config", str(cfg), "--prompt", "x", "--backend", "onnxruntime"])
    assert "backend onnxruntime needs fp32 or fp16" in one_line_error(res)
    d["build"] = {"onnx_dtypes": ["fp32"]}
    d["buckets"] = {"tokens": [8], "cache": [256]}
    res = CliRunner().invoke(main, ["run", "--config", str(write_config(tmp_path, d)), "--prompt", "x",
                                    "--backend", "onnxruntime"])
    assert "token buckets only" in one_line_error(res)
    assert not (tmp_path / "cache").exists()


def test_a_subclassed_strategy_keeps_its_parents_options():
    class LongChain(ChainSpeculative):
        name = "longchain"
    assert LongChain(k=3).max_tree_size() == 4
    with pytest.raises(ConfigError, match="k = 0"):
        LongChain(k=0)


def test_strategy_options_are_checked_from_python_too():
    with pytest.raises(ConfigError, match="strategies.dyspec.batch = 0"):
        DySpec(batch=0)
    with pytest.raises(ConfigError, match="strategies.gsd.top_k = 0"):
        GSD(top_k=0)
    with pytest.raises(ConfigError, match="strategies.chain.k = 2.5"):
        ChainSpeculative(2.5)
    with pytest.raises(ConfigError, match="unknown key"):
        make_strategy("ar", k=3)
    assert make_strategy("dyspec", budget=5).budget == 5


def test_bad_config_via_cli_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    bad = write_config(tmp_path, _set(tiny_dict(), "strategies.dyspec", {"batch": 0}))
    res = CliRunner().invoke(main, ["run", "--config", str(bad), "--prompt", "x"])
    assert "strategies.dyspec.batch = 0" in one_line_error(res)
    assert not (tmp_path / "cache").exists()
    res = CliRunner().invoke(main, ["build", "--config", str(bad), "--output", str(tmp_path / "out")])
    assert "strategies.dyspec.batch" in one_line_error(res)
    assert not (tmp_path / "out").exists()


def test_config_round_trips_through_the_manifest():
    cfg = load_config(TINY)
    again = Config.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict() and again.digest() == cfg.digest()


# ---------------------------------------------------------------------------------------------
# `trtspec run` checks before engines are built or loaded
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["--prompt", ""], "prompt is empty"),
    (["--prompt", "x", "--show-tree", "tree.jpg"], ".png or .svg"),
    (["--prompt", "x", "--max-new-tokens", "100000"], "exceeds the KV capacity 512"),
    (["--prompt", "x", "--temperature", "nan"], "temperature must be a finite number"),
    (["--prompt", "x", "--temperature", "inf"], "temperature must be a finite number"),
    (["--prompt", "x", "--strategy", "staged", "--max-new-tokens", "500"], "staged's largest step"),
])
def test_run_refuses_before_building(tmp_path, monkeypatch, args, words):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    res = CliRunner().invoke(main, ["run", "--config", str(TINY), *args])
    assert words in res.output and "Traceback" not in res.output and res.exit_code != 0, res.output
    assert not (tmp_path / "cache").exists(), "engines were built before the input was checked"


def test_strategy_needing_a_draft_refused_before_building(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))
    d = tiny_dict()
    del d["draft"]
    d["strategy"] = "ar"
    cfg = write_config(tmp_path, d)
    res = CliRunner().invoke(main, ["run", "--config", str(cfg), "--prompt", "x", "--strategy", "gsd"])
    assert "needs a draft model" in one_line_error(res)
    assert not (tmp_path / "cache").exists()
    d["strategy"] = "chain"
    with pytest.raises(ConfigError, match="strategy 'chain' needs a draft model"):
        load_config(write_config(tmp_path, d))


def test_sampling_settings_refuse_nan_and_inf():
    for kw in ({"temperature": math.nan}, {"temperature": math.inf}, {"temperature": -1.0},
               {"temperature": 1.0, "top_p": math.nan}, {"temperature": 1.0, "top_p": 0.0},
               {"temperature": 1.0, "top_k": -1}, {"temperature": 1.0, "top_k": True}):
        with pytest.raises(RequestError):
            SamplingParams(**kw)
    assert SamplingParams(1e-7).greedy      # 1/T would overflow: treated as greedy, as vLLM does


# ---------------------------------------------------------------------------------------------
# Only the project's errors become one line; a bug keeps its traceback
# ---------------------------------------------------------------------------------------------

def test_internal_bug_is_not_hidden(tmp_path, monkeypatch):
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path / "cache"))

    def broken(*a, **k):
        raise ValueError("an internal bug")
    monkeypatch.setattr(Generator, "generate", broken)
    res = CliRunner().invoke(main, ["run", "--config", str(TINY), "--prompt", "x", "--json"])
    assert isinstance(res.exception, ValueError) and "an internal bug" in str(res.exception)


def test_project_errors_share_one_base():
    from trtspec.engines.manifest import EngineError
    from trtspec.export.spec import SpecError
    from trtspec.tools.datasets import DatasetError
    for cls in (ConfigError, RequestError, EngineError, SpecError, CapacityError, DatasetError):
        assert issubclass(cls, TrtspecError)
