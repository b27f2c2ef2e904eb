"""The core lossless property under greedy decoding: every strategy emits exactly `ar`'s tokens.

Tiny random pairs of every family (gemma3: a layer over a 12-key window; qwen3_moe: routed
experts); prompts drawn from a small token subset so that n-gram matches (and hence n-gram drafts)
actually happen.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from conftest import reference_logits
from trtspec.runtime.generator import Generator
from trtspec.runtime.strategies import ChainSpeculative, NGramSpeculative

ARCHS = ["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3", "qwen3_moe"]
ALPHABET = [3, 17, 99, 250, 401, 7]
SETTINGS = settings(max_examples=int(os.environ.get("TRTSPEC_EQ_EXAMPLES", "40")), deadline=None, database=None)

prompts = hst.lists(hst.sampled_from(ALPHABET), min_size=1, max_size=40)


def check_result(res, strategy: str, k: int) -> None:
    assert res.stats["new_tokens"] == len(res.token_ids)
    assert len(res.steps) == res.stats["target_steps"]
    for s in res.steps:
        assert 0 <= s.accepted <= k
        assert s.accepted < s.tree_size
        if strategy == "chain":
            assert s.tree_size == k + 1
        else:                       # ngram: as many nodes as the drafter found, at most k drafts
            assert 1 <= s.tree_size <= k + 1


@SETTINGS
@given(prompt=prompts, k=hst.integers(1, 6), max_new=hst.integers(1, 40))
@pytest.mark.parametrize("arch", ARCHS)
def test_chain_equals_ar(arch_gens, arch, prompt, k, max_new):
    gen = arch_gens[arch]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=max_new).token_ids
    assert len(ref) == max_new
    res = gen.generate(prompt, strategy=ChainSpeculative(k), max_new_tokens=max_new)
    assert res.token_ids == ref, f"chain k={k} diverged from ar"
    check_result(res, "chain", k)


@SETTINGS
@given(prompt=prompts, k=hst.integers(1, 10), max_new=hst.integers(1, 40))
@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_equals_ar(arch_gens, arch, prompt, k, max_new):
    gen = arch_gens[arch]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=max_new).token_ids
    res = gen.generate(prompt, strategy=NGramSpeculative(k), max_new_tokens=max_new)
    assert res.token_ids == ref, f"ngram k={k} diverged from ar"
    check_result(res, "ngram", k)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_strategy_options_by_name(llama_pair, llama_gen, k):
    """Strategies configured by name through `strategy_options` behave like the objects."""
    gen = llama_pair.generator(capacity=256, strategy_options={"chain": {"k": k}, "ngram": {"k": k + 2}})
    prompt = [3, 17, 99, 3, 17, 99, 3, 17]
    ref = llama_gen.generate(prompt, strategy="ar", max_new_tokens=30).token_ids
    chain = gen.generate(prompt, strategy="chain", max_new_tokens=30)
    ngram = gen.generate(prompt, strategy="ngram", max_new_tokens=30)
    assert chain.token_ids == ref and ngram.token_ids == ref
    assert all(s.tree_size == k + 1 for s in chain.steps)
    assert max(s.tree_size for s in ngram.steps) <= k + 3


def test_speculation_is_not_vacuous(llama_gen):
    """The equivalence tests only mean something if drafts are really accepted (and rejected)."""
    chain_acc = chain_rej = ngram_acc = 0
    for prompt in ([3, 17, 99, 250, 3, 17, 99], [7] * 12, [401, 250, 7, 3, 401, 250]):
        r = llama_gen.generate(prompt, strategy=ChainSpeculative(4), max_new_tokens=40)
        chain_acc += sum(s.accepted for s in r.steps)
        chain_rej += sum(s.accepted < 4 for s in r.steps)
        r = llama_gen.generate(prompt, strategy=NGramSpeculative(8), max_new_tokens=40)
        ngram_acc += sum(s.accepted for s in r.steps)
    assert chain_acc > 10 and chain_rej > 0
    assert ngram_acc > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_ar_equals_full_recompute(arch_pairs, arch_gens, arch):
    """`ar` itself (KV cache, commit, masks) against greedy decoding by full recomputation."""
    pair, gen = arch_pairs[arch], arch_gens[arch]
    for prompt in ([3, 17, 99, 3, 17], [250]):
        seq = list(prompt)
        for _ in range(16):
            seq.append(int(reference_logits(pair.target, seq)[-1].argmax()))
        assert gen.generate(prompt, strategy="ar", max_new_tokens=16).token_ids == seq[len(prompt):]


@pytest.mark.parametrize("strategy", ["ar", "chain", "ngram"])
def test_stop_token_ends_generation(llama_pair, llama_gen, strategy):
    prompt = [3, 17, 99, 250, 3, 17, 99]
    ref = llama_gen.generate(prompt, strategy="ar", max_new_tokens=40).token_ids
    for j in (0, 1, 5, 17, 39):
        stop = ref[j]
        first = ref.index(stop)
        gen = Generator(llama_pair.target_engine, llama_pair.draft_engine, capacity=256, stop_ids={stop})
        out = gen.generate(prompt, strategy=strategy, max_new_tokens=40).token_ids
        assert out == ref[:first + 1], f"stop id {stop}: expected to end at index {first}"
        # iter_tokens yields the same tokens step by step, the stop id last.
        pieces = list(gen.iter_tokens(prompt, strategy=strategy, max_new_tokens=40))
        assert sum(pieces, []) == out and all(pieces)
        assert pieces[-1][-1] == stop


@pytest.mark.parametrize("strategy", ["ar", "chain", "ngram"])
def test_max_new_tokens_exact(llama_gen, strategy):
    prompt = [7, 7, 7, 7, 3, 7, 7, 7]
    ref = llama_gen.generate(prompt, strategy="ar", max_new_tokens=40).token_ids
    for n in (1, 2, 3, 5, 8, 13, 40):
        res = llama_gen.generate(prompt, strategy=strategy, max_new_tokens=n)
        assert res.token_ids == ref[:n]
        assert res.stats["new_tokens"] == n
        pieces = list(llama_gen.iter_tokens(prompt, strategy=strategy, max_new_tokens=n))
        assert sum(pieces, []) == ref[:n]
