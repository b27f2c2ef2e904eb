"""Bad input is refused before work starts, in one line that names it; real bugs keep their traceback.

Covers: config validation at load (every section, every strategy's options), checks `run` makes
before building or loading engines, the draft-KV reservation, sampling settings, backend choice from
the manifest, what a build writes (no TensorRT unless asked, the loaders' eos ids), a draft whose
embedding table differs from the target's, and the chat default that answers to the end of turn.
"""
from __future__ import annotations

import copy

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from conftest import reference_logits, with_chat_template
from trtspec.cli import main
from trtspec.assembly.config import CONFIGS_DIR, MAX_OPSET, Config, ConfigError, load_config
from trtspec.assembly.build import build_engines
from trtspec.assembly.load import load_generator
from trtspec.engines.manifest import EngineError, verify
from trtspec.engines.torch_engine import TorchEngine
from trtspec.errors import RequestError, TrtspecError
from trtspec.export.model import Decoder
from trtspec.export.tiny import random_state, tiny_spec
from trtspec.runtime.generator import Generator, room_for
from trtspec.runtime.kv_cache import CapacityError
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import GSD, STRATEGIES, Cascade, ChainSpeculative, DySpec, Staged, make_strategy
from trtspec.runtime.prompts import Prompt, encode

TINY = CONFIGS_DIR / "tiny-random.yaml"
QUIET = dict(log=lambda *a, **k: None)


def tiny_dict() -> dict:
    return yaml.safe_load(TINY.read_text())


def write_config(tmp_path: Path, d: dict, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(d))
    return p


def one_line_error(res) -> str:
    """The CLI refused: non-zero exit, no traceback, a single message line. Returns it."""
    assert res.exit_code != 0, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    err = [line for line in lines if line.startswith(("Error:", "Usage:", "Try "))]
    assert err, res.output
    return next(line for line in lines if line.startswith("Error:"))


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
                              ("target.quantize", "int8", "quantize the target to int4, or only the draft"),
                              ("device", "cuda", "quantized engines run on CPU")):
        with pytest.raises(ConfigError, match=words):
            load_config(write_config(tmp_path, _set(copy.deepcopy(d), key, value)))


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


# ---------------------------------------------------------------------------------------------
# Draft KV is reserved: near the capacity, refused before the first token, never mid-stream
# ---------------------------------------------------------------------------------------------

DRAFT_HEAVY = [GSD(top_k=4, sibling_ratio=0.0, confidence=0.0, budget=6, max_draft_nodes=60, max_depth=8),
               Cascade(k_draft=5, k_mag=1, mag_len=8), DySpec("heap", budget=20, batch=5), Staged(budget=16)]


@pytest.mark.parametrize("strat", DRAFT_HEAVY, ids=lambda s: s.name)
def test_draft_rows_are_reserved(llama_pair, strat):
    prompt = [5, 9, 13, 5, 9, 13, 5, 9]
    n = 24
    exact = len(prompt) + n + strat.max_rows()
    gen = llama_pair.generator(capacity=exact)        # exactly enough: runs to the end
    ref = llama_pair.generator(capacity=256).generate(prompt, strategy="ar", max_new_tokens=n).token_ids
    assert gen.generate(prompt, strategy=strat, max_new_tokens=n).token_ids == ref
    small = llama_pair.generator(capacity=exact - 1)  # one row short: refused before any token
    it = small.iter_tokens(prompt, strategy=strat, max_new_tokens=n)
    with pytest.raises(CapacityError, match=f"draft {strat.max_draft_rows()}"):
        next(it)
    assert all(b.forwards == 0 for b in small.batchers.values())


# ---------------------------------------------------------------------------------------------
# A draft whose embedding table is smaller or larger than the target's
# ---------------------------------------------------------------------------------------------

def draft_with_vocab(target: Decoder, vocab: int, noise: float = 0.05, seed: int = 1) -> Decoder:
    """The target's weights, noised, with the embedding/head tables cut or extended to `vocab` rows."""
    spec = tiny_spec(vocab_size=vocab, num_layers=target.spec.num_layers)
    extra = random_state(spec, seed)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in target.state_dict().items():
        v = v.clone()
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            v = torch.cat([v, extra[k][v.shape[0]:]])[:vocab]
        state[k] = v + noise * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v
    return Decoder.from_state(spec, state, torch.float32)


@pytest.mark.parametrize("draft_vocab", [500, 530])
def test_draft_vocab_differs_greedy(llama_pair, draft_vocab):
    draft = draft_with_vocab(llama_pair.target, draft_vocab)
    gen = Generator(llama_pair.target_engine, TorchEngine(draft), capacity=256)
    prompt = [3, 17, 99, 250, 3, 17, 99]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=30).token_ids
    for name in STRATEGIES:
        assert gen.generate(prompt, strategy=name, max_new_tokens=30).token_ids == ref, name
    for name in ("chain", "dyspec"):     # sampled drafts: q rows in the target's vocabulary
        res = gen.generate(prompt, strategy=name, max_new_tokens=30, sampling=SamplingParams(1.0), seed=1)
        assert len(res.token_ids) == 30 and max(res.token_ids) < 512


@pytest.mark.parametrize("draft_vocab", [12, 20])
def test_draft_vocab_differs_sampling_exact(small_pair, draft_vocab):
    """Chain with sampled drafts from a 12- or 20-row draft over a 16-token target: the first
    token is still distributed as the target's (chi-square, as in test_sampling_exact)."""
    from test_sampling_exact import PASS_P, chisquare_p, reference_probs
    draft = draft_with_vocab(small_pair.target, draft_vocab, noise=0.15)
    gen = Generator(small_pair.target_engine, TorchEngine(draft), capacity=64)
    prompt, sp = [1, 2, 3, 4, 1, 2, 3], SamplingParams(1.0)
    p1 = reference_probs(reference_logits(small_pair.target, prompt)[-1], sp)
    counts = np.zeros(16)
    accepted = 0
    for i in range(1200):
        res = gen.generate(prompt, strategy=ChainSpeculative(2), max_new_tokens=1, sampling=sp, seed=i)
        counts[res.token_ids[0]] += 1
        accepted += res.steps[0].accepted
    pval = chisquare_p(counts, p1)
    print(f"[pvalue] draft vocab {draft_vocab}: {pval:.3g}, drafts accepted {accepted}")
    assert accepted > 100 and pval > PASS_P


# ---------------------------------------------------------------------------------------------
# Engine folders: the backend they were built for, what a build writes
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ort_folder(tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("hard") / "ort"
    lines: list[str] = []
    build_engines(load_config(TINY), out, backend="onnxruntime", log=lambda *a, **k: lines.append(" ".join(map(str, a))))
    return out, lines


@pytest.fixture(scope="module")
def torch_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hard") / "torch"
    build_engines(load_config(TINY), out, backend="torch", **QUIET)
    return out


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
    real = build_mod.load_model

    def with_eos(entry, role):
        model = real(entry, role)
        model.spec.extra["eos_token_ids"] = [7, 11]
        return model
    monkeypatch.setattr(build_mod, "load_model", with_eos)
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


# ---------------------------------------------------------------------------------------------
# Chat answers run to the end of the turn; a cut answer says so
# ---------------------------------------------------------------------------------------------

def test_chat_default_runs_to_the_end_of_turn(torch_folder, tmp_path):
    eng = with_chat_template(torch_folder, tmp_path)
    res = CliRunner().invoke(main, ["run", "--engines", str(eng), "--prompt", "x = 1", "--chat", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    gen = load_generator(eng)
    strat = gen.strategy(gen.config.strategy)
    n_prompt = len(encode(Prompt(id="p", text="x = 1"), gen.tokenizer, chat=True))
    assert out["max_new_tokens"] == min(1024, room_for(n_prompt, strat, gen.config.max_seq_len)) > 128
    stopped = out["token_ids"][-1] in gen.stop_ids
    assert out["finish_reason"] == ("stop" if stopped else "length")
    if not stopped:
        assert out["stats"]["new_tokens"] == out["max_new_tokens"]
    res = CliRunner().invoke(main, ["run", "--engines", str(eng), "--prompt", "x = 1", "--chat"])
    assert res.exit_code == 0
    assert ("the answer was cut at" in res.output) == (not stopped)


def test_finish_reason_stop_and_length(llama_pair):
    prompt = [3, 17, 99, 250]
    ref = llama_pair.generator().generate(prompt, max_new_tokens=12).token_ids
    stop = ref[5]
    gen = llama_pair.generator(stop_ids={stop})
    res = gen.generate(prompt, strategy="chain", max_new_tokens=12)
    assert res.token_ids == ref[: ref.index(stop) + 1] and res.finish_reason == "stop"
    assert llama_pair.generator().generate(prompt, max_new_tokens=12).finish_reason == "length"


def test_plain_prompt_default_cap_says_so(torch_folder):
    res = CliRunner().invoke(main, ["run", "--engines", str(torch_folder), "--prompt", "x = 1", "--strategy", "ar"])
    assert res.exit_code == 0
    n = int(res.output.split("[ar] ")[1].split()[0])
    assert n <= 128 and ("default cap of 128 new tokens" in res.output) == (n == 128)
