"""Prefix caching and n > 1 (issue 28, items 4 and 5): exact, and really used.

- A generator with the prefix cache and one without run the same sequence of requests (a shared
  system prompt, different questions; greedy and sampled, every strategy): every output is the same,
  and the cached one really skipped prefill (hit tokens counted, fewer target forwards).
- After a warm start the slot's KV rows equal a cold prefill's bit for bit (torch and ONNX Runtime):
  row invariance is what makes a copied row the row the request would have computed.
- Eviction by recency keeps the store within its blocks; a store of 0 tokens is off.
- n > 1: one prefill (the other choices copy its rows), choice 0 equals a lone request with the same
  seed, the set is reproducible by seed, the choices differ, greedy choices are all ar's output, and
  the choices' sampled tokens are distributed as the target's (chi-square).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_pair
from test_batching import ort_folder  # noqa: F401 - fixture
from test_sampling_exact import PASS_P, T1, exact_first_two, fit

from trtspec.assembly.load import load_generator
from trtspec.errors import RequestError
from trtspec.runtime.prefix_cache import BLOCK
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import STRATEGIES, Staged

SYSTEM = [(7 * i) % 509 + 2 for i in range(200)]      # a 200-token "system prompt"
CACHED = len(SYSTEM) // BLOCK * BLOCK                  # the part of it stored: its full blocks
QUESTIONS = [[5, 6, 7], [9, 9], [11, 12, 13, 14], [5, 6, 8]]


@pytest.fixture(scope="module")
def pair():
    return make_pair("qwen2", vocab_size=512, num_layers=2, seed=3)


def run_all(gen, strategy: str, sampled: bool, scope: str) -> list[list[int]]:
    """The requests' outputs; a strategy with a global suffix history gets its own `scope` (the history
    is process-wide: the two generators must not draft from each other's requests)."""
    strat = gen.strategy(strategy, scope=scope) if hasattr(gen.strategy(strategy), "scope") else strategy
    sp = SamplingParams(temperature=1.0) if sampled else SamplingParams()
    return [gen.generate(SYSTEM + q, strategy=strat, max_new_tokens=16, sampling=sp, seed=i).token_ids
            for i, q in enumerate(QUESTIONS)]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_warm_equals_cold_every_strategy(pair, strategy):
    warm_gen, cold_gen = pair.generator(capacity=512), pair.generator(capacity=512, prefix_cache=0)
    assert warm_gen.stores and not cold_gen.stores
    try:
        for sampled in (False, True):
            f_warm, f_cold = warm_gen.batchers["target"].forwards, cold_gen.batchers["target"].forwards
            assert run_all(warm_gen, strategy, sampled, "warm") == run_all(cold_gen, strategy, sampled, "cold")
        store = warm_gen.stores["target"]
        assert store.hit >= (2 * len(QUESTIONS) - 1) * CACHED       # every request after the first hits
        assert warm_gen.batchers["target"].forwards - f_warm <= cold_gen.batchers["target"].forwards - f_cold
    finally:
        warm_gen.close()
        cold_gen.close()


def slot_rows(gen, prompt: list[int]) -> torch.Tensor:
    """The target KV rows a request leaves of its prompt (the slot is not cleared when it ends)."""
    res = gen.generate(prompt, strategy="ar", max_new_tokens=1)
    assert res.token_ids
    cache = gen.slots[0].target.cache
    return cache.buf[:, :, :, :len(prompt) - 1].clone(), res.stats["cached_prompt_tokens"]


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_warm_rows_equal_cold_rows_bit_for_bit(pair, ort_folder, backend):  # noqa: F811
    def make(prefix_cache):
        if backend == "torch":
            return pair.generator(capacity=512, slots=1, prefix_cache=prefix_cache)
        return load_generator(ort_folder, backend="onnxruntime", slots=1, prefix_cache=prefix_cache)
    warm_gen, cold_gen = make(None), make(0)
    try:
        prompt = SYSTEM + [5, 6, 7]
        warm_gen.generate(SYSTEM + [9, 9, 9, 9], strategy="ar", max_new_tokens=2)     # stores the system prompt
        warm, hit = slot_rows(warm_gen, prompt)
        cold, none = slot_rows(cold_gen, prompt)
        assert hit == CACHED and none == 0
        assert torch.equal(warm, cold)
    finally:
        warm_gen.close()
        cold_gen.close()


def test_eviction_by_recency(pair):
    gen = pair.generator(capacity=512, slots=1, prefix_cache=4 * BLOCK)         # room for 4 blocks
    try:
        a = [2 + i % 100 for i in range(2 * BLOCK + 1)]
        b = [300 + i % 100 for i in range(2 * BLOCK + 1)]
        c = [150 + i % 100 for i in range(2 * BLOCK + 1)]
        store = gen.stores["target"]
        gen.generate(a, max_new_tokens=1)
        gen.generate(b, max_new_tokens=1)
        assert gen.generate(a, max_new_tokens=1).stats["cached_prompt_tokens"] == 2 * BLOCK   # a is now the newer
        gen.generate(c, max_new_tokens=1)                                              # evicts b, not a
        assert store.evicted == 2 and len(store.where) == 4
        assert gen.generate(a, max_new_tokens=1).stats["cached_prompt_tokens"] == 2 * BLOCK
        assert gen.generate(b, max_new_tokens=1).stats["cached_prompt_tokens"] == 0
    finally:
        gen.close()


# ---------------------------------------------------------------------------------------------
# n > 1
# ---------------------------------------------------------------------------------------------

def test_choices_share_one_prefill(pair):
    gen = pair.generator(capacity=512, slots=4, prefix_cache=0)
    try:
        prompt = SYSTEM + [5, 6, 7]
        sp = SamplingParams(temperature=1.0)
        f0 = gen.batchers["target"].forwards
        fixed = Staged(budget=6)          # sampled: a fixed tree (budget: auto sizes trees by the batch)
        hs = gen.submit_choices(prompt, 4, seed=11, strategy=fixed, max_new_tokens=12, sampling=sp)
        outs = [h.result(timeout=120) for h in hs]
        assert [o.stats["cached_prompt_tokens"] for o in outs] == [0] + [len(prompt) - 1] * 3
        lone = gen.generate(prompt, strategy=fixed, max_new_tokens=12, sampling=sp, seed=11)
        assert outs[0].token_ids == lone.token_ids
        again = [h.result(timeout=120).token_ids for h in
                 gen.submit_choices(prompt, 4, seed=11, strategy=fixed, max_new_tokens=12, sampling=sp)]
        assert again == [o.token_ids for o in outs]
        assert len({tuple(o.token_ids) for o in outs}) == 4
        greedy = [h.result(timeout=120).token_ids for h in gen.submit_choices(prompt, 3, strategy="chain",
                                                                              max_new_tokens=12)]
        assert greedy == [gen.generate(prompt, strategy="ar", max_new_tokens=12).token_ids] * 3
        assert f0 < gen.batchers["target"].forwards
        with pytest.raises(RequestError, match="n must be"):
            gen.submit_choices(prompt, 0)
    finally:
        gen.close()


def test_choices_sampled_exact(small_pair):
    """Choices 2..n (copied prompt rows, derived seeds) sample the target's distribution."""
    gen = small_pair.generator(capacity=64, slots=4)
    try:
        prompt = [1, 2, 3, 4, 1, 2, 3]
        joint = exact_first_two(small_pair.target, prompt, T1)
        counts = np.zeros((16, 16), dtype=np.int64)
        for i in range(300):
            for h in gen.submit_choices(prompt, 4, seed=70_000 + i, strategy="chain", max_new_tokens=2, sampling=T1):
                counts[tuple(h.result(timeout=60).token_ids)] += 1
        p_first, p_joint = fit(counts, joint)
        print(f"[pvalue] n=4 choices chain: first {p_first:.3g} joint {p_joint:.3g}")
        assert p_first > PASS_P and p_joint > PASS_P
    finally:
        gen.close()


