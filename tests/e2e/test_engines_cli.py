"""Engine folders and the CLI on the tiny-random config: build, verify, run, refuse bad input."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import reference_logits, with_chat_template
from trtspec.cli import main
from trtspec.assembly.config import ConfigError, load_config
from trtspec.assembly.build import build_engines
from trtspec.assembly.load import load_generator
from trtspec.engines.manifest import EngineError, verify

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-random.yaml"


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eng") / "tiny"
    build_engines(load_config(TINY), out, backend="onnxruntime", log=lambda *a, **k: None)
    return out


@pytest.fixture(scope="module")
def torch_engines(tmp_path_factory) -> Path:
    """The same config built for torch (an engine folder holds one backend's weights)."""
    out = tmp_path_factory.mktemp("eng") / "tiny-torch"
    build_engines(load_config(TINY), out, backend="torch", log=lambda *a, **k: None)
    return out


def copy_engines(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def test_engine_folder_layout(engines):
    m = verify(engines)
    assert m["format"] == "trtspec-engine" and m["contract_version"] == 4
    for role in ("target", "draft"):
        arts = m["models"][role]["artifacts"]
        assert set(arts) == {"ort_fp32"}, arts             # the weights once: the ORT-optimized graph only
        assert sorted(p.name for p in (engines / role).iterdir()) == ["model.fp32.ort.onnx"]
        names = [i["name"] for i in m["models"][role]["io"]["inputs"]]
        assert names[:4] == ["input_ids", "position_ids", "attn_mask", "logit_rows"]
    for rel, info in m["files"].items():
        assert (engines / rel).stat().st_size == info["bytes"]
    assert set(m["versions"]) >= {"trtspec", "torch", "onnx", "onnxruntime", "tensorrt"}
    assert not list(engines.parent.glob("*.partial-*")), "build left a partial folder behind"


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_backends_agree_with_ar(engines, torch_engines, backend):
    gen = load_generator(torch_engines if backend == "torch" else engines)
    assert gen.backend == backend
    prompt = gen.tokenizer("def fib(n):\n    return fib(n-1) + fib(n-2)\n")["input_ids"]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=24).token_ids
    for strategy in ("chain", "ngram"):
        assert gen.generate(prompt, strategy=strategy, max_new_tokens=24).token_ids == ref


def test_torch_and_onnxruntime_same_tokens(engines, torch_engines):
    a = load_generator(torch_engines)
    b = load_generator(engines)
    prompt = a.tokenizer("import json\nimport os\n")["input_ids"]
    assert a.generate(prompt, max_new_tokens=20).token_ids == b.generate(prompt, max_new_tokens=20).token_ids


def test_tampered_file_is_refused(engines, tmp_path):
    eng = copy_engines(engines, tmp_path)
    verify(eng)  # fills the verified-hash cache; tampering must still be caught
    weights = eng / "target" / "model.fp32.ort.onnx"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(EngineError, match="sha256.*rebuild"):
        verify(eng)


def test_missing_file_and_manifest_are_refused(engines, tmp_path):
    eng = copy_engines(engines, tmp_path)
    (eng / "draft" / "model.fp32.ort.onnx").unlink()
    with pytest.raises(EngineError, match="missing"):
        verify(eng)
    (eng / "manifest.json").unlink()
    with pytest.raises(EngineError, match="no manifest.json"):
        verify(eng)


def test_cli_run_json(engines):
    res = CliRunner().invoke(main, ["run", "--engines", str(engines), "--prompt", "def add(a, b):",
                                    "--strategy", "chain", "--max-new-tokens", "12", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output.strip().splitlines()[-1])
    assert len(out["token_ids"]) == out["stats"]["new_tokens"] <= 12
    for key in ("new_tokens", "seconds", "tokens_per_s", "target_steps", "mean_accepted",
                "draft_seconds", "verify_seconds"):
        assert key in out["stats"]


def test_cli_streams_text(engines):
    res = CliRunner().invoke(main, ["run", "--engines", str(engines), "--prompt", "x = 1",
                                    "--max-new-tokens", "8"])
    assert res.exit_code == 0, res.output
    assert "tokens in" in res.output


def test_cli_refuses_tampered_engines_with_fix(engines, tmp_path):
    eng = copy_engines(engines, tmp_path)
    (eng / "tokenizer" / "tokenizer.json").write_text("{}")
    res = CliRunner().invoke(main, ["run", "--engines", str(eng), "--prompt", "x"])
    assert res.exit_code == 1
    assert "trtspec build" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("args, words", [
    (["run", "--engines", "/nonexistent/eng", "--prompt", "x"], "does not exist"),
    (["run", "--config", "no-such-config", "--prompt", "x"], "not found"),
    (["run", "--prompt", "x", "--prompt-file", __file__], "exactly one"),
    (["build", "--config", "no-such-config", "--output", "/tmp/x"], "not found"),
])
def test_cli_bad_input_one_line(args, words):
    res = CliRunner().invoke(main, args)
    assert res.exit_code != 0
    assert words in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("name,folder", [("qwen3-8b", "Qwen3-8B"), ("gemma-3-1b", "gemma-3-1b-it"),
                                         ("phi-4-mini", "Phi-4-mini-instruct"), ("qwen3-30b-a3b", "Qwen3-30B-A3B")])
def test_a_shipped_config_without_its_weights_is_refused_in_one_line(tmp_path, monkeypatch, name, folder):
    """qwen3-8b, gemma-3-1b, phi-4-mini and qwen3-30b-a3b ship as configs only: built where their
    folders are not, one line names the path and the fix, exit 1, and no output folder is left behind."""
    monkeypatch.setenv("HOME", str(tmp_path))                      # ~/models/... is not there
    res = CliRunner().invoke(main, ["build", "--config", name, "--output", str(tmp_path / "out")])
    assert res.exit_code == 1, res.output
    line = res.output.strip()
    assert "\n" not in line and "Traceback" not in line, res.output
    assert f"model path {tmp_path}/models/{folder} does not exist" in line and "point the config's model:" in line
    assert not (tmp_path / "out").exists()


WINDOWED = {  # tiny HF models whose attention is windowed (8 keys) in a context of 128
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=8, pad_token_id=0, eos_token_id=None,
                                                   bos_token_id=None)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=8, sliding_window_pattern=2, num_hidden_layers=2, head_dim=16, query_pre_attn_scalar=24,
        pad_token_id=0, eos_token_id=None, bos_token_id=None)),
}


@pytest.mark.parametrize("arch", list(WINDOWED))
def test_a_sliding_window_model_builds_and_equals_transformers(tmp_path, arch):
    """A Hugging Face folder whose layers attend over a window shorter than the context (Phi-3-mini's
    2,047 keys; Gemma 3's 512-1,024 in five layers of six) builds to ONNX Runtime and its greedy
    output, `ar` and a tree strategy alike, equals transformers' own generate on the same weights,
    over a prompt and an output far past the window."""
    import shutil

    import transformers

    from trtspec.assembly.sources import TINY_TOKENIZER
    from trtspec.export.tokenizer import load_tokenizer
    from trtspec.runtime.prompts import Prompt, encode
    cfg_cls, model_cls, extra = WINDOWED[arch]
    folder = tmp_path / arch
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{
        **dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256), **extra})).eval()
    with torch.no_grad():             # peaked distributions (no argmax near-ties between two fp32 implementations)
        for name, p in model.named_parameters():
            p.normal_(0, 0.3 if "norm" in name else 1.0 if "embed" in name else 2.0 / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    for f in TINY_TOKENIZER.iterdir():
        shutil.copy(f, folder)
    config = tmp_path / f"{arch}.yaml"
    config.write_text(f"name: {arch}\ntarget: {{model: '{folder}'}}\nmax_seq_len: 128\nstrategy: ar\n")
    res = CliRunner().invoke(main, ["build", "--config", str(config), "--output", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    text = "def window(x):\n    return [x, x + 1, x * 2]  # well past eight tokens"
    ids = encode(Prompt(id="p", text=text), load_tokenizer(folder, cache=False))
    assert len(ids) > 16
    with torch.no_grad():
        t = torch.tensor([ids])
        ref = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=40, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    for strategy in ("ar", "ngram"):
        res = CliRunner().invoke(main, ["run", "--engines", str(tmp_path / "out"), "--prompt", text, "--strategy",
                                        strategy, "--max-new-tokens", "40", "--json", "--threads", "1"])
        assert res.exit_code == 0, res.output
        got = json.loads(res.output.strip().splitlines()[-1])["token_ids"]
        assert got and got == ref[:len(got)], (strategy, got, ref)      # (it may end early at a stop id)


def test_prompt_too_long(engines):
    res = CliRunner().invoke(main, ["run", "--engines", str(engines), "--prompt", "x = 1\n" * 400,
                                    "--max-new-tokens", "200"])
    assert res.exit_code == 1 and "max_seq_len" in res.output


def test_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: {model: 'tiny:0'}\nstrategie: chain\n")
    with pytest.raises(ConfigError, match="strategie: unknown key"):
        load_config(bad)
    bad.write_text("name: x\ntarget: {model: 'tiny:0', dtype: fp8}\n")
    with pytest.raises(ConfigError, match="dtype"):
        load_config(bad)


def test_build_refuses_existing_output(engines):
    with pytest.raises(EngineError, match="--force"):
        build_engines(load_config(TINY), engines, log=lambda *a, **k: None)


def test_int8_draft_is_lossless(torch_engines):
    """A weight-only int8 draft changes only acceptance, never the output."""
    gen = load_generator(torch_engines)
    from trtspec.engines.quantize import quantize_decoder
    from trtspec.engines.torch_engine import TorchEngine
    from trtspec.runtime.generator import Generator
    q = Generator(gen.target_engine, TorchEngine(quantize_decoder(gen.draft_engine.model, "int8")),
                  capacity=512, strategy_options=gen.config.strategies)
    import torch
    assert any(isinstance(m, torch.ao.nn.quantized.dynamic.Linear) for m in q.draft_engine.model.modules())
    prompt = gen.tokenizer("for i in range(10):\n    print(i)\n")["input_ids"]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=24).token_ids
    for strategy in ("chain", "staged", "dyspec", "gsd", "cascade"):
        assert q.generate(prompt, strategy=strategy, max_new_tokens=24).token_ids == ref, strategy


def test_quantized_target_refused(tmp_path):
    bad = tmp_path / "q.yaml"
    bad.write_text("name: x\ntarget: {model: 'tiny:0', quantize: int8}\n")
    with pytest.raises(ConfigError, match="torch backend does not quantize targets; use backend onnxruntime"):
        load_config(bad)


def test_cli_inspect_compare(engines):
    res = CliRunner().invoke(main, ["inspect", "--engines", str(engines), "--compare"])
    assert res.exit_code == 0, res.output
    assert "hashes OK" in res.output and "ort_fp32" in res.output
    # The folder holds no torch weights: the torch reference is rebuilt from the config's source.
    line = next(l for l in res.output.splitlines() if l.startswith("onnxruntime  vs torch"))
    assert line.endswith("OK") and "argmax agreement 100%" in line
    for backend in ("torch", "onnxruntime"):     # tree rows = one-token rows, per backend
        line = next(l for l in res.output.splitlines() if l.startswith(f"{backend:<12} batch invariance"))
        assert line.endswith("OK") and "argmax agreement 9/9" in line
    assert "polygraphy" in res.output      # the TensorRT comparison says why it did not run


def test_tensorrt_backend_refused_with_reason(engines):
    with pytest.raises(EngineError, match="TensorRT"):
        load_generator(engines, backend="tensorrt")


def test_cli_chat_without_template_is_a_clear_error(engines):
    res = CliRunner().invoke(main, ["run", "--engines", str(engines), "--prompt", "hi", "--chat"])
    assert res.exit_code == 2 and "chat template" in res.output and "Traceback" not in res.output


def test_cli_chat_uses_the_template(engines, tmp_path):
    """With a template, --chat encodes through it (transformers 5 returns a BatchEncoding)."""
    eng = with_chat_template(engines, tmp_path)
    res = CliRunner().invoke(main, ["run", "--engines", str(eng), "--prompt", "x = 1", "--chat",
                                    "--max-new-tokens", "4", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output.strip().splitlines()[-1])["stats"]["new_tokens"] == 4


def test_quantized_onnxruntime_folder(tmp_path):
    """int4 target + int8 draft as MatMulNBits graphs: the scheme is in the manifest, every strategy
    reproduces the folder's own `ar`, and inspect checks batch invariance."""
    cfg = load_config(TINY).with_backend("onnxruntime")
    cfg.target.quantize, cfg.draft.quantize = "int4", "int8"
    folder = build_engines(cfg, tmp_path / "q", log=lambda *a, **k: None)
    models = verify(folder)["models"]
    assert models["target"]["artifacts"] == {"ort_fp32": "target/model.fp32-int4.ort.onnx"}
    assert (models["target"]["quantize"]["bits"], models["draft"]["quantize"]["bits"]) == (4, 8)
    assert models["target"]["quantize"]["matmuls_quantized"] == 2 * 7 + 1      # 2 layers x 7 + the LM head
    gen = load_generator(folder)
    prompt = gen.tokenizer("for i in range(10):\n    print(i)\n")["input_ids"]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=24).token_ids
    fp32 = load_generator(build_engines(load_config(TINY).with_backend("onnxruntime"), tmp_path / "f",
                                        log=lambda *a, **k: None))
    assert fp32.generate(prompt, strategy="ar", max_new_tokens=24).token_ids != ref   # it is another model
    for strategy in ("chain", "ngram", "staged", "dyspec", "gsd", "cascade"):
        assert gen.generate(prompt, strategy=strategy, max_new_tokens=24).token_ids == ref, strategy
    res = CliRunner().invoke(main, ["inspect", "--engines", str(folder), "--compare"])
    assert res.exit_code == 0, res.output
    assert "quantized  int4 weight-only: com.microsoft.MatMulNBits, block 32" in res.output
    line = next(l for l in res.output.splitlines() if l.startswith("onnxruntime  batch invariance"))
    assert line.endswith("OK") and "argmax agreement 9/9" in line
    assert "int4 weights: differs from fp32 by design" in res.output


def every_strategy_is_ar(gen, tokens: int) -> None:
    """Every tree strategy reproduces the generator's own `ar` on two code prompts, alone and all
    submitted at once (sharing batches); closes `gen`."""
    prompts = [gen.tokenizer(p)["input_ids"] for p in ("for i in range(10):\n    print(i)\n", "def f(x):\n")]
    refs = [gen.generate(p, strategy="ar", max_new_tokens=tokens).token_ids for p in prompts]
    strategies = ("chain", "ngram", "staged", "dyspec", "gsd", "cascade", "suffix")
    try:
        for strategy in strategies:
            for p, ref in zip(prompts, refs):
                assert gen.generate(p, strategy=strategy, max_new_tokens=tokens).token_ids == ref, strategy
        handles = [(ref, gen.submit(p, strategy=s, max_new_tokens=tokens))
                   for s in strategies for p, ref in zip(prompts, refs)]
        assert all(h.result().token_ids == ref for ref, h in handles)
    finally:
        gen.close()


@pytest.fixture(scope="module")
def int8_folder(tmp_path_factory):
    cfg = load_config(TINY).with_backend("onnxruntime")
    cfg.target.quantize, cfg.target.activations, cfg.draft.quantize = "int4", "int8", "int8"
    return build_engines(cfg, tmp_path_factory.mktemp("int8") / "q", log=lambda *a, **k: None)


def test_an_int8_activation_target_is_exact(int8_folder, tmp_path):
    """int4 target with int8 activations (MatMulNBits accuracy level 4): the build gives it exact
    attention (`attention: auto` = by logical order, KV in fp32), its tree rows equal one-token rows
    bit for bit over 300 random trees (chunks of 64 keys: trees cross chunk edges), and every strategy
    reproduces its `ar`, alone and sharing a batch. The same graph with its attention as it lies
    (physical order) is not exact (the check can fail)."""
    from trtspec.engines.onnxruntime_engine import OrtEngine
    from trtspec.engines.stream import build_graph
    from trtspec.export.tiny import tiny_pair, tiny_spec
    from trtspec.engines.weights import StateWeights
    from trtspec.tools.inspect_engines import count_differences

    folder = int8_folder
    info = verify(folder)["models"]["target"]
    assert info["attention"] == "logical" and info["quantize"]["accuracy_level"] == 4
    assert {i["dtype"] for i in info["io"]["inputs"] if i["name"].startswith("past_")} == {"fp32"}
    res = CliRunner().invoke(main, ["inspect", "--engines", str(folder), "--compare", "--trees", "300"])
    assert res.exit_code == 0, res.output
    assert "attention  by logical order, in chunks of 64 keys" in res.output
    line = next(l for l in res.output.splitlines() if "exactness: 300 random trees" in l)
    assert " 0 of " in line and line.endswith("bit-identical"), line
    alone = CliRunner().invoke(main, ["inspect", "--engines", str(folder), "--trees", "3"])
    assert alone.exit_code == 2 and "--trees goes with --compare" in alone.output
    assert "engine folder" not in alone.output                         # refused before any work
    far = CliRunner().invoke(main, ["inspect", "--engines", str(folder), "--compare", "--trees", "20",
                                    "--longest", "100000"])
    line = next(l for l in far.output.splitlines() if "exactness: 20 random trees" in l)
    cap = load_config(TINY).max_seq_len - 24
    assert f"cached lengths 16-{cap} (capped at max_seq_len" in line and " 0 of " in line, line
    lone = CliRunner().invoke(main, ["inspect", "--engines", str(folder), "--longest", "500"])
    assert lone.exit_code == 2 and "--longest goes with --trees" in lone.output

    gen = load_generator(folder)
    assert gen.target_engine.kv_dtype == torch.float32
    every_strategy_is_ar(gen, 24)

    target, _ = tiny_pair(tiny_spec(**load_config(TINY).target.tiny.model_dump()), seed=0)
    build_graph(StateWeights(target.spec, target.state_dict()), tmp_path / "level4.onnx", torch.float32,
                exact=False, quantize="int4", accuracy_level=4)
    engine = OrtEngine(tmp_path / "level4.onnx", target.spec, intra_op_threads=1)
    differ, nodes, _, _ = count_differences(engine, target.spec.vocab_size, trees=40, longest=200)
    assert differ > nodes // 2, (differ, nodes)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3", "phi3", "gemma3", "qwen3_moe"])
def test_every_family_is_exact_in_trees(tmp_path, arch):
    """Each family beside llama (test_an_int8_activation_target_is_exact), among them Gemma 3's form
    (tiny:0 as gemma3: a layer over a 12-key window beside a global one) and Qwen3-MoE's (2 of 4
    experts per token, rows of one tree routed to different experts), as int4 targets with int8
    activations (exact attention by logical order, the default): 300 random trees of up to 16 nodes
    (deeper than the window) at cached 16-200, each node's logits bit-identical to the same path
    decoded one token at a time; for the two new forms, every strategy reproduces its `ar`, alone and sharing a batch
    (the others' strategies: tests/integration, on tiny pairs of each family)."""
    from trtspec.export.tiny import tiny_pair, tiny_spec
    cfg = load_config(TINY).with_backend("onnxruntime")
    for entry in (cfg.target, cfg.draft):
        entry.tiny.arch = arch
    cfg.target.quantize, cfg.target.activations, cfg.draft.quantize = "int4", "int8", "int8"
    folder = build_engines(cfg, tmp_path / arch, log=lambda *a, **k: None)
    info = verify(folder)["models"]["target"]
    assert info["spec"]["arch"] == arch and info["attention"] == "logical"
    import onnx                     # a quantized graph runs rotary as ONNX Runtime's own node
    ops = [n.op_type for n in onnx.load(str(next((folder / "target").glob("*.ort.onnx"))),
                                        load_external_data=False).graph.node]
    assert ops.count("RotaryEmbedding") == 2 * info["spec"]["num_layers"] and "Neg" not in ops, ops
    if arch == "gemma3":
        assert info["spec"]["sliding_window"] == 12
    elif arch == "qwen3_moe":  # the rows of a 16-token forward pick different experts
        target, _ = tiny_pair(tiny_spec(**cfg.target.tiny.model_dump()), seed=0)
        picked = []
        target.model.layers[1].mlp.gate.register_forward_hook(
            lambda m, i, out: picked.append(out.topk(2, -1).indices.sort(-1).values))
        reference_logits(target, list(range(40, 56)))
        assert len({tuple(p) for p in picked[0][0].tolist()}) >= 3, picked
        moe = sum(target.spec.has_experts(i) for i in range(target.spec.num_layers))    # int4 experts on QMoE
        assert moe and info["quantize"]["experts_quantized"] == info["quantize"]["experts_total"] == 3 * moe
        assert info["quantize"]["experts"].startswith("int4: com.microsoft.QMoE"), info["quantize"]
        graph = onnx.load(str(next((folder / "target").glob("model.*-int4*.onnx"))), load_external_data=False)
        assert sum(n.op_type == "Scan" for n in graph.graph.node) == moe       # one row per QMoE call
    res = CliRunner().invoke(main, ["inspect", "--engines", str(folder), "--compare", "--trees", "300"])
    assert res.exit_code == 0, res.output
    line = next(l for l in res.output.splitlines() if "exactness: 300 random trees" in l)
    assert " 0 of " in line and line.endswith("bit-identical"), line
    if arch == "qwen3_moe":
        assert "experts    6 of 6 expert weights quantized (int4: com.microsoft.QMoE" in res.output, res.output
    if arch not in ("gemma3", "qwen3_moe"):   # the older families' strategies: tests/integration's tiny pairs
        return
    every_strategy_is_ar(load_generator(folder), 32)


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen3_moe"])
def test_attention_in_fp64_is_exact_too(tmp_path, arch):
    """`attention: fp64` (Decoder.exact_attention, the default before attention by logical order):
    the int8-activation target's attention and KV run in fp64, so a tree row's logits round to the
    one-token row's; 0 of the nodes of 300 random trees differ (gemma3: deeper than its 12-key window;
    qwen3_moe: rows routed to different experts), and every strategy reproduces its `ar`, alone and
    batched."""
    cfg = load_config(TINY).with_backend("onnxruntime")
    for entry in (cfg.target, cfg.draft):
        entry.tiny.arch = arch
    cfg.target.quantize, cfg.target.activations, cfg.draft.quantize = "int4", "int8", "int8"
    cfg.target.attention = "fp64"
    folder = build_engines(cfg, tmp_path / arch, log=lambda *a, **k: None)
    info = verify(folder)["models"]["target"]
    assert info["attention"] == "fp64"
    assert {i["dtype"] for i in info["io"]["inputs"] if i["name"].startswith("past_")} == {"fp64"}
    res = CliRunner().invoke(main, ["inspect", "--engines", str(folder), "--compare", "--trees", "300"])
    assert res.exit_code == 0, res.output
    assert "attention  fp64, KV cache fp64" in res.output
    line = next(l for l in res.output.splitlines() if "exactness: 300 random trees" in l)
    assert " 0 of " in line and line.endswith("bit-identical"), line
    gen = load_generator(folder)
    assert gen.target_engine.kv_dtype == torch.float64
    every_strategy_is_ar(gen, 24)


def test_an_int8_activation_target_samples_exactly(int8_folder):
    """Sampled `staged` on the int8-activation folder: the first two tokens are distributed as that
    engine's own one-token forwards give them (chi-square, temperature 1)."""
    from test_sampling_exact import PASS_P, T1, fit, reference_probs, sample_first
    from trtspec.runtime.effects import drive
    from trtspec.runtime.runner import ModelRunner

    gen = load_generator(int8_folder)
    prompt = gen.tokenizer("def f(x):\n")["input_ids"]

    def probs(tokens):
        runner = ModelRunner.alone(gen.target_engine, capacity=len(tokens) + 8)
        if len(tokens) > 1:
            drive(runner.prefill(tokens[:-1]))
        logits = drive(runner.extend([tokens[-1]]))
        return reference_probs(logits.reshape(-1, logits.shape[-1])[-1].float(), T1)

    p1 = probs(prompt)
    joint = np.zeros((len(p1), len(p1)))
    for t in np.flatnonzero(p1):
        joint[t] = p1[t] * probs(prompt + [int(t)])
    counts = sample_first(gen, prompt, "staged", T1, 1200, 30_000)
    p_first, p_joint = fit(counts, joint)
    gen.close()
    print(f"[pvalue] int8-activation folder staged: first {p_first:.3g} joint {p_joint:.3g}")
    assert p_first > PASS_P and p_joint > PASS_P, (p_first, p_joint)
