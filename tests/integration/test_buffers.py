"""KV caches and step buffers are allocated once per Generator and reused across requests."""
from __future__ import annotations

import pytest
import torch

from trtspec.errors import ConfigError, RequestError
from trtspec.export.tiny import tiny_spec
from trtspec.runtime.generator import Generator
from trtspec.runtime.kv_cache import CapacityError, KVPool
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import ChainSpeculative, NGramSpeculative, Staged

CAPACITY = 512


def snapshot(gen: Generator) -> dict:
    """Identity, address and shape of every preallocated buffer."""
    out = {"seq": [(id(s.seq), s.seq.ctypes.data, s.seq.shape) for s in gen.slots]}
    for name, batcher in gen.batchers.items():
        out[name + ".runners"] = [id(getattr(s, name)) for s in gen.slots]
        out[name + ".caches"] = [id(getattr(s, name).cache) for s in gen.slots]
        for attr in ("_mask", "_ids", "_pos", "_rows"):
            t = getattr(batcher, attr)
            out[f"{name}.{attr}"] = (id(t), t.data_ptr(), tuple(t.shape))
        buf = gen.pools[name].buf
        out[name + ".kv"] = (id(buf), buf.data_ptr(), tuple(buf.shape), buf.dtype)
    return out


@pytest.fixture(scope="module")
def gen(llama_pair) -> Generator:
    return llama_pair.generator(capacity=CAPACITY)


def test_buffers_allocated_once_and_reused(gen, llama_pair):
    spec = llama_pair.spec
    before = snapshot(gen)
    head = gen.batchers["target"].headroom                   # padded batch rows spill past capacity
    assert before["target.kv"][2] == (spec.num_layers, 2, len(gen.slots), spec.num_kv_heads,
                                      CAPACITY + head, spec.head_dim)
    assert before["draft.kv"][2][4] == CAPACITY + head

    prompt = [3, 17, 99, 250, 3, 17, 99]
    t1 = SamplingParams(temperature=1.0)
    runs = [("ar", {}), ("chain", {}), ("ngram", {}), (ChainSpeculative(6), {}), (NGramSpeculative(10), {}),
            ("chain", {"sampling": t1, "seed": 3}), ("ngram", {"sampling": t1, "seed": 4}),
            ("ar", {"sampling": SamplingParams(0.8, top_k=20, top_p=0.9)})]
    total_steps = 0
    for strategy, kw in runs:
        res = gen.generate(prompt, strategy=strategy, max_new_tokens=120, **kw)
        assert len(res.token_ids) == 120
        total_steps += res.stats["target_steps"]
        assert snapshot(gen) == before, f"a buffer was reallocated by strategy {strategy!r}"
    assert total_steps > 300
    # A long prompt: chunked prefill (max_step_tokens=256) through the same buffers.
    long_prompt = (prompt * 50)[:300]
    gen.generate(long_prompt, strategy="chain", max_new_tokens=60)
    gen.generate(long_prompt, strategy="ngram", max_new_tokens=60)
    assert snapshot(gen) == before
    # Streaming uses the same path.
    for _ in gen.iter_tokens(prompt, strategy="chain", max_new_tokens=30):
        assert snapshot(gen) == before


def test_results_independent_of_previous_requests(gen):
    """Reused buffers carry no state between requests."""
    prompt = [401, 7, 250, 7, 401]
    first = gen.generate(prompt, strategy="ar", max_new_tokens=40).token_ids
    gen.generate([9] * 200, strategy="chain", max_new_tokens=100)   # fill the caches with other data
    assert gen.generate(prompt, strategy="chain", max_new_tokens=40).token_ids == first
    assert gen.generate(prompt, strategy="ngram", max_new_tokens=40).token_ids == first
    assert gen.generate(prompt, strategy="ar", max_new_tokens=40).token_ids == first


@pytest.mark.parametrize("strategy,tree", [("ar", 1), (ChainSpeculative(4), 5), (NGramSpeculative(8), 9)])
def test_capacity_error_is_clear(llama_pair, strategy, tree):
    g = llama_pair.generator(capacity=64)
    before = snapshot(g)
    prompt = [3, 17] * 10                                   # 20 tokens
    max_new = 64 - 20 - tree + 1                            # one row too many
    with pytest.raises(CapacityError) as info:
        g.generate(prompt, strategy=strategy, max_new_tokens=max_new)
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "exceeds the KV capacity 64" in msg
    assert "prompt (20)" in msg and f"max_new_tokens ({max_new})" in msg and f"= {64 + 1} tokens" in msg
    assert "max_seq_len" in msg                              # says what to change
    # The exact fit runs to completion, and the failed request left the generator usable.
    res = g.generate(prompt, strategy=strategy, max_new_tokens=max_new - 1)
    assert len(res.token_ids) == max_new - 1
    assert snapshot(g) == before


def test_prompt_alone_over_capacity(llama_pair):
    g = llama_pair.generator(capacity=32)
    with pytest.raises(CapacityError, match="exceeds the KV capacity 32"):
        g.generate(list(range(40)), strategy="ar", max_new_tokens=1)


def test_kv_cache_slots_capacity_error():
    cache = KVPool(tiny_spec(num_layers=1, hidden_size=32), 1, capacity=8, dtype=torch.float32).caches[0]
    cache.advance(6)
    views = cache.slots(2)                 # one [2, D] view per (key/value, KV head) of the layer
    assert len(views) == 2 * cache.spec.num_kv_heads and all(v.shape == (2, cache.spec.head_dim) for v in views)
    with pytest.raises(CapacityError, match=r"needs 9 KV rows but the cache holds 8"):
        cache.slots(3)


# ---------------------------------------------------------------------------------------------
# Request validation: clear errors up front (regression tests for two bugs found by these tests)
# ---------------------------------------------------------------------------------------------

def test_strategy_object_without_draft_gives_clear_error(llama_pair):
    g = Generator(llama_pair.target_engine, None, capacity=64)
    with pytest.raises(ValueError, match="needs a draft model"):
        g.generate([1, 2, 3], strategy="chain", max_new_tokens=5)     # the by-name path is fine
    with pytest.raises(ValueError, match="needs a draft model"):
        g.generate([1, 2, 3], strategy=ChainSpeculative(2), max_new_tokens=5)


@pytest.mark.parametrize("make", [lambda: NGramSpeculative(300), lambda: ChainSpeculative(300),
                                  lambda: Staged(budget=200, max_rounds=8, stage2_len=10)],
                         ids=["ngram300", "chain300", "staged281"])
def test_tree_larger_than_max_step_tokens(llama_pair, make):
    g = llama_pair.generator(capacity=1024)
    prompt = [5, 6] * 200              # periodic: the n-gram drafter proposes all k tokens
    ref = g.generate(prompt, strategy="ar", max_new_tokens=20).token_ids
    try:
        out = g.generate(prompt, strategy=make(), max_new_tokens=20).token_ids
    except (ConfigError, RequestError, CapacityError) as e:   # a clear refusal up front is acceptable
        assert "255" in str(e) or "256" in str(e) or "max_step_tokens" in str(e), str(e)
        return
    assert out == ref


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads /proc/self/statm (Linux)")
def test_a_kv_pool_becomes_resident_as_its_rows_are_written():
    """A pool of 4 slots x 8,192 rows (512 MiB) costs memory for the rows written, not for its size;
    its rows read zero until written."""
    spec = tiny_spec(num_layers=8, hidden_size=256, num_heads=4, num_kv_heads=2)
    before = _resident_bytes()
    pool = KVPool(spec, slots=4, capacity=8192, dtype=torch.float64)
    assert pool.buf.numel() * 8 == 8 * 2 * 4 * 2 * 8192 * spec.head_dim * 8 == 512 << 20
    cache = pool.caches[1]
    assert float(cache.buf[:, :, :, :64].abs().sum()) == 0.0
    cache.buf[:, :, :, :64].fill_(1.0)                   # one slot's first 64 rows
    assert float(pool.buf[:, :, 1, :, :64].mean()) == 1.0 and float(pool.buf[:, :, 0, :, :64].abs().sum()) == 0.0
    assert _resident_bytes() - before < 64 << 20
