"""Static-shape buckets and the CUDA-graph engine's machinery, on the torch CPU backend.

On CPU the graph engine cannot capture (it logs why and replays its static-buffer function
eagerly), but bucket selection, padding, static buffers and per-shape graph keys are the same code
that runs on a GPU, so this is where they are tested.
"""
from __future__ import annotations

import pytest

from trtspec.engines.cuda_graphs import GraphedTorchEngine
from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime.generator import Generator
from trtspec.runtime.runner import bucket

BUCKETS = {"tokens": [1, 4, 8, 16, 32], "cache": [64, 128, 256]}
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 9, 9, 1, 2]
STRATEGIES = ["ar", "chain", "ngram", "staged", "dyspec", "gsd", "cascade"]


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(tiny_spec(vocab_size=512, num_layers=2), seed=3)


@pytest.fixture(scope="module")
def reference(pair):
    g = Generator(TorchEngine(pair[0]), TorchEngine(pair[1]), capacity=256)
    return {s: g.generate(PROMPT, strategy=s, max_new_tokens=30).token_ids for s in STRATEGIES}


def test_bucket_choice():
    assert bucket(3, [1, 4, 8]) == 4 and bucket(8, [1, 4, 8]) == 8 and bucket(1, [1, 4]) == 1
    assert bucket(9, [1, 4, 8]) == 9          # beyond the largest bucket: exact shape
    assert bucket(5, None) == 5 and bucket(5, []) == 5


@pytest.mark.parametrize("engine_cls", [TorchEngine, GraphedTorchEngine])
def test_bucketed_runs_equal_unbucketed(pair, reference, engine_cls):
    kw = {"device": "cpu"}
    g = Generator(engine_cls(pair[0], **kw), engine_cls(pair[1], **kw), capacity=256, buckets=BUCKETS)
    for s in STRATEGIES:
        assert g.generate(PROMPT, strategy=s, max_new_tokens=30).token_ids == reference[s], s


def test_graphs_keyed_by_bucketed_shape_and_reused(pair):
    target, draft = GraphedTorchEngine(pair[0], device="cpu"), GraphedTorchEngine(pair[1], device="cpu")
    assert target.fallback_reason and "CUDA" in target.fallback_reason
    g = Generator(target, draft, capacity=256, buckets=BUCKETS)
    g.generate(PROMPT, strategy="staged", max_new_tokens=30)
    keys = set(target.graphs)
    # Every shape is a bucket: T in the token buckets, C+T - T in the cache buckets.
    for _, t, total, _ in keys:
        assert t in BUCKETS["tokens"] and total - t in BUCKETS["cache"]
    addrs = {k: (gr.ids.data_ptr(), gr.mask.data_ptr(), gr.logits.data_ptr()) for k, gr in target.graphs.items()}
    for _ in range(3):
        g.generate(PROMPT, strategy="staged", max_new_tokens=30)
    assert set(target.graphs) == keys, "the same requests must not create new graphs"
    assert {k: (gr.ids.data_ptr(), gr.mask.data_ptr(), gr.logits.data_ptr())
            for k, gr in target.graphs.items()} == addrs
    assert sum(gr.replays for gr in target.graphs.values()) > len(keys)
    # Target and draft caches never share a graph (keys carry the cache buffer).
    assert not set(target.graphs) & set(draft.graphs)


def test_unbucketed_shapes_multiply_graphs(pair):
    target = GraphedTorchEngine(pair[0], device="cpu")
    Generator(target, None, capacity=256).generate(PROMPT, strategy="ar", max_new_tokens=20)
    bucketed = GraphedTorchEngine(pair[0], device="cpu")
    Generator(bucketed, None, capacity=256, buckets=BUCKETS).generate(PROMPT, strategy="ar", max_new_tokens=20)
    assert len(bucketed.graphs) < len(target.graphs)


def test_staged_bucket_scatter_on_cpu(pair):
    """The staging used by the TensorRT and ONNX Runtime CUDA-graph engines: inputs land in fixed
    buffers and the staged new KV rows go to the moving cache slots."""
    import torch

    from trtspec.engines.staging import StagedBucket
    spec = pair[0].spec
    cache = TorchEngine(pair[0]).new_cache(64)
    cache.length = 10
    b = StagedBucket.make(spec, cache.buf.dtype, "cpu", t=3, total=16, r=2)
    addrs = [b.inputs["attn_mask"].data_ptr(), b.logits.data_ptr(), b.new_kv[0].data_ptr()]
    ids = torch.tensor([5, 6, 7])
    b.load(cache, ids, torch.tensor([10, 11, 11]), torch.ones(3, 16, dtype=torch.bool), torch.tensor([0, 2]))
    assert b.slot.tolist() == [10, 11, 12] and b.inputs["input_ids"].tolist() == [5, 6, 7]
    for n, x in enumerate(b.new_kv):
        x.fill_(n + 1)
    b.scatter_new_kv(cache)
    assert float(cache.buf[1, 1, 10:13].min()) == 4 and float(cache.buf[1, 1, 13].abs().max()) == 0
    assert addrs == [b.inputs["attn_mask"].data_ptr(), b.logits.data_ptr(), b.new_kv[0].data_ptr()]
