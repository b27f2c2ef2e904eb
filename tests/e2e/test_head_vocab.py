"""A draft's reduced LM head (`draft: {head: N}`, engines/head_vocab.py): the head's tokens are the
corpus' most counted ones plus every special token; the graph's logits are the full head's on those
tokens and LOW (probability 0) elsewhere, tied or not, dense or quantized; and a folder whose draft
has such a head gives every strategy the target's own `ar` output."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from trtspec.assembly.build import build_engines
from trtspec.assembly.config import ConfigError, Config, load_config
from trtspec.assembly.load import load_generator
from trtspec.engines.head_vocab import LOW, corpus, head_tokens, token_counts
from trtspec.engines.stream import build_graph
from trtspec.engines.weights import StateWeights
from trtspec.export.onnx_export import _probe_outputs
from trtspec.export.tiny import tiny_pair, tiny_spec

from test_engines_cli import TINY


class Tok:
    """A tokenizer stub: one token per digit, two special tokens."""
    all_special_ids = [10, 11]
    added_tokens_decoder = {11: "<eos>"}

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[ord(c) - ord("0") for c in t] for t in texts]}


def test_the_head_is_the_most_counted_tokens_and_every_special_one():
    counts = np.array([5, 0, 9, 9, 1, 0, 0, 0, 0, 3, 0, 0, 7])
    ids = head_tokens(Tok(), 6, len(counts), counts)
    assert ids.tolist() == [0, 2, 3, 10, 11, 12]           # specials, then by count (ties by id)
    assert head_tokens(Tok(), 13, 13, counts).tolist() == list(range(13))
    assert head_tokens(Tok(), 1, len(counts), counts).tolist() == [10, 11]   # specials are never left out


def test_token_counts_read_the_standard_library(tmp_path):
    files = corpus()
    assert len(files) > 100 and all(p.suffix == ".py" and "test" not in p.parts for p in files)
    (tmp_path / "a.py").write_text("0120")
    assert token_counts(Tok(), 12, [tmp_path / "a.py"]).tolist() == [2, 1, 1] + [0] * 9


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("quantize", ["none", "int4"])
def test_the_graph_spreads_the_head_s_logits_over_the_vocabulary(tie, quantize, tmp_path):
    spec = tiny_spec(arch="qwen2", tie=tie)
    _, draft = tiny_pair(spec, seed=5)
    state = {k: v for k, v in draft.state_dict().items() if not (tie and k == "lm_head.weight")}
    ids = np.sort(np.random.default_rng(0).choice(spec.vocab_size, 100, replace=False))
    level = 4 if quantize != "none" else 1
    full = build_graph(StateWeights(spec, state), tmp_path / "full.onnx", torch.float32, quantize=quantize,
                       accuracy_level=level)
    rec = build_graph(StateWeights(spec, state), tmp_path / "head.onnx", torch.float32, quantize=quantize,
                      accuracy_level=level, head=ids)
    if quantize != "none":      # the head is quantized too, even when tied to the embedding
        assert rec["matmuls_quantized"] == full["matmuls_quantized"] + (1 if tie else 0)
        assert full["joined_products"] == 2 * spec.num_layers          # q/k/v and gate/up per layer
    a, b = _probe_outputs(tmp_path / "full.onnx")[0], _probe_outputs(tmp_path / "head.onnx")[0]
    assert a.shape == b.shape and a.shape[-1] == spec.vocab_size
    out = np.ones(spec.vocab_size, bool)
    out[ids] = False
    assert (b[..., out] == np.float32(LOW)).all()
    if quantize == "none" or not tie:       # the same weights on the head's columns
        np.testing.assert_allclose(b[..., ids], a[..., ids], rtol=1e-5, atol=1e-5)
    else:                                    # the embedding quantized: close, not equal
        np.testing.assert_allclose(b[..., ids], a[..., ids], rtol=0.1, atol=0.1 * float(np.abs(a).max()))


def test_head_is_for_onnx_drafts_only():
    d = load_config(TINY).to_dict()
    with pytest.raises(ConfigError, match="target.head"):
        Config.from_dict({**d, "backend": "onnxruntime", "target": {**d["target"], "head": 64}})
    with pytest.raises(ConfigError, match="draft.head.*onnxruntime"):
        Config.from_dict({**d, "draft": {**d["draft"], "head": 64}})


def test_a_draft_with_a_reduced_head_changes_no_output(tmp_path):
    d = load_config(TINY).to_dict()
    cfg = Config.from_dict({**d, "backend": "onnxruntime", "draft": {**d["draft"], "head": 200}})
    out = tmp_path / "eng"
    build_engines(cfg, out, log=lambda *a, **k: None)
    gen = load_generator(out)
    import json
    assert json.loads((out / "manifest.json").read_text())["models"]["draft"]["head"]["tokens"] >= 200
    prompt = gen.tokenizer("def fib(n):\n    return fib(n-1) + fib(n-2)\n")["input_ids"]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=32).token_ids
    for strategy in ("chain", "staged", "dyspec"):
        res = gen.generate(prompt, strategy=strategy, max_new_tokens=32)
        assert res.token_ids == ref, strategy
    gen.close()
