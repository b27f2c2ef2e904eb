"""Static-shape buckets and the CUDA-graph engine's machinery, on the torch CPU backend.

On CPU the graph engine cannot capture (it logs why and replays its static-buffer function
eagerly), but bucket selection, padding, static buffers and per-shape graph keys are the same code
that runs on a GPU, so this is where they are tested.
"""
from __future__ import annotations

import pytest

from conftest import GPU_LIKE

from trtspec.engines.cuda_graphs import GraphedTorchEngine
from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime.generator import Generator
from trtspec.runtime.batch import bucket

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
    # costs given: measuring them here would add the measurement's own shapes (its prefill) to the graphs
    g = Generator(target, draft, capacity=256, buckets=BUCKETS, costs=GPU_LIKE)
    g.generate(PROMPT, strategy="staged", max_new_tokens=30)
    keys = set(target.graphs)
    # Every shape is a bucket: T in the token buckets, C+T - T in the cache buckets, and the
    # logit rows are 1 or the whole token bucket (static per bucket).
    for b, t, total, r in keys:
        assert t in BUCKETS["tokens"] and total - t in BUCKETS["cache"] and r in (1, t)
    def addrs(engine):
        return {k: (gr.inputs["input_ids"].data_ptr(), gr.inputs["attn_mask"].data_ptr(), gr.past.data_ptr(),
                    gr.logits.data_ptr()) for k, gr in engine.graphs.items()}
    before = addrs(target)
    for _ in range(3):
        g.generate(PROMPT, strategy="staged", max_new_tokens=30)
    assert set(target.graphs) == keys, "the same requests must not create new graphs"
    assert addrs(target) == before
    assert sum(gr.runs for gr in target.graphs.values()) > len(keys)


def test_unbucketed_shapes_multiply_graphs(pair):
    target = GraphedTorchEngine(pair[0], device="cpu")
    Generator(target, None, capacity=256).generate(PROMPT, strategy="ar", max_new_tokens=20)
    bucketed = GraphedTorchEngine(pair[0], device="cpu")
    Generator(bucketed, None, capacity=256, buckets=BUCKETS).generate(PROMPT, strategy="ar", max_new_tokens=20)
    assert len(bucketed.graphs) < len(target.graphs)


def test_staged_bucket_scatter_on_cpu(pair):
    """The staging shared by the graph engines (torch CUDA graphs, TensorRT, ONNX Runtime CUDA):
    inputs and each row's past land in fixed buffers, and the staged new KV rows go to each row's
    moving slot position; the graph never writes a live cache row."""
    import torch

    from trtspec.engines.staging import StagedBucket
    spec = pair[0].spec
    pool = TorchEngine(pair[0]).new_pool(3, 64)
    a, b = pool.caches[2], pool.caches[0]
    a.length, b.length = 10, 4
    pool.buf.normal_()
    live = pool.buf.clone()
    g = StagedBucket.make(spec, pool.buf.dtype, "cpu", b=2, t=3, total=16, r=2)
    addrs = [g.inputs["attn_mask"].data_ptr(), g.logits.data_ptr(), g.new_kv.data_ptr(), g.past.data_ptr()]
    g.load([a, b], torch.tensor([[5, 6, 7], [1, 2, 3]]), torch.tensor([[10, 11, 11], [4, 5, 6]]),
           torch.ones(2, 3, 16, dtype=torch.bool), torch.tensor([[0, 2], [1, 2]]))
    assert g.inputs["input_ids"].tolist() == [[5, 6, 7], [1, 2, 3]]
    assert torch.equal(g.past[:, 0], torch.stack([blk[:13] for blk in a.blocks]))   # row 0 = slot 2's past
    assert torch.equal(g.past[:, 1], torch.stack([blk[:13] for blk in b.blocks]))
    assert torch.equal(pool.buf, live), "loading must not touch the cache"
    for n in range(g.new_kv.shape[0]):
        g.new_kv[n, 0].fill_(n + 1)
        g.new_kv[n, 1].fill_(-(n + 1))
    g.scatter_new_kv([a, b])
    assert all(bool((blk[10:13] == n + 1).all()) for n, blk in enumerate(a.blocks))   # each head's rows
    assert all(bool((blk[4:7] == -(n + 1)).all()) for n, blk in enumerate(b.blocks))
    assert torch.equal(a.buf[:, :, :, 13:], live[:, :, 2, :, 13:]) and torch.equal(b.buf[:, :, :, :4], live[:, :, 0, :, :4])
    assert torch.equal(pool.buf[:, :, 1], live[:, :, 1]), "a slot outside the batch was written"
    assert addrs == [g.inputs["attn_mask"].data_ptr(), g.logits.data_ptr(), g.new_kv.data_ptr(), g.past.data_ptr()]
