"""DraftTree: the draft model's token tree grown in its KV scratch, and GSD's DAG helpers.

(a) After random growth (several batched `feed` rounds, random branching, chains reviewed in the
    same forward, a draft cache lagging the sequence by 1-3 pending tokens), `probs[node]` of every
    fed node equals the draft's distribution at the end of a plain causal forward over
    `seq + path(node)` without any cache: masks, positions and scratch rows are right.
(b) `commit(path)` leaves draft cache rows [0, length) equal to a fresh prefill of the committed
    tokens, for paths ending at an unfed leaf and paths through a `borrowed` node (the commit stops
    before it); the next DraftTree re-feeds what was not committed and again matches the reference.
    Also end to end: after every step of every tree strategy, the draft cache equals a fresh prefill.
(c) Review semantics: chain tokens equal to the draft argmax are kept, the first mismatch and
    everything after it is dead and absent from `token_tree()`; lenience keeps p >= max / lenience.
(d) GSD: `_match` refuses merges onto an ancestor (or self) and merges that would close a cycle;
    `_unroll` gives an ancestor-closed tree of <= budget + 1 nodes whose sibling tokens are distinct
    and whose root paths are exactly the DAG's root paths (all of them when the budget allows).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from conftest import reference_logits
from trtspec.runtime.decode import DecodeState
from trtspec.runtime.draft_model import DraftTree
from trtspec.runtime.effects import drive
from trtspec.runtime.runner import ModelRunner
from trtspec.runtime.sampling import SamplingParams, probs_from_logits
from trtspec.runtime.strategies import GSD, Cascade, DySpec, Staged
from trtspec.runtime.strategies import gsd as gsd_mod

SETTINGS = settings(max_examples=int(os.environ.get("TRTSPEC_DRAFT_TREE_EXAMPLES", "12")), deadline=None, database=None)
CAP = 160
ALPHABET = [3, 17, 99, 250, 401, 7]
GREEDY = SamplingParams()
TKP = SamplingParams(temperature=0.8, top_k=40, top_p=0.9)
ATOL = 2e-5


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

def make_state(pair, prompt: list[int], lag: int = 1, sampling: SamplingParams = GREEDY) -> DecodeState:
    """A DecodeState whose draft cache holds prompt[:-lag] (lag >= 1: the root is never cached)."""
    draft = ModelRunner.alone(pair.draft_engine, CAP)
    drive(draft.prefill(list(prompt[: len(prompt) - lag])))
    st = DecodeState(None, draft, sampling, np.zeros(CAP, dtype=np.int64), 0)
    st.append(list(prompt))
    return st


def path_nodes(tree: DraftTree, node: int) -> np.ndarray:
    """Root..node, ascending (nodes are topologically ordered)."""
    return np.flatnonzero(tree.anc[node, : tree.size])


def path_tokens(tree: DraftTree, node: int) -> list[int]:
    return tree.tokens[path_nodes(tree, node)[1:]].tolist()


def ref_dist(pair, st: DecodeState, toks: list[int]) -> torch.Tensor:
    logits = reference_logits(pair.draft, st.tokens().tolist() + toks)[-1:]
    if st.sampling.greedy:
        return torch.softmax(logits.float(), -1)[0]
    return probs_from_logits(logits, st.sampling)[0]


def ref_argmax(pair, st: DecodeState, toks: list[int]) -> int:
    return int(reference_logits(pair.draft, st.tokens().tolist() + toks)[-1].argmax())


def fresh_kv(pair, tokens: list[int]) -> torch.Tensor:
    r = ModelRunner.alone(pair.draft_engine, CAP)
    drive(r.prefill(tokens))
    return r.cache.buf[:, :, :, : r.cache.length].clone()


def assert_cache_is_prefill(pair, runner: ModelRunner, tokens: list[int]) -> None:
    c = runner.cache
    assert c.scratch == 0
    assert c.length == len(tokens)
    torch.testing.assert_close(c.buf[:, :, :, : c.length], fresh_kv(pair, tokens), atol=ATOL, rtol=1e-4)


def assert_probs_match_reference(pair, st: DecodeState, tree: DraftTree) -> int:
    fed = [n for n in range(tree.size) if tree.fed(n)]
    for n in fed:
        torch.testing.assert_close(tree.probs[n], ref_dist(pair, st, path_tokens(tree, n)), atol=ATOL, rtol=1e-4,
                                   msg=lambda m, n=n: f"node {n} (path {path_tokens(tree, n)}): {m}")
    return len(fed)


def review_chain(pair, st, tree, node: int, keep: int, length: int, rng) -> tuple[list[int], int]:
    """A chain after `node` whose first `keep` tokens are the draft's argmax continuation and whose
    next token is not; returns (chain, how many the review must keep)."""
    prefix = path_tokens(tree, node)
    chain: list[int] = []
    for i in range(length):
        best = ref_argmax(pair, st, prefix + chain)
        if i < keep:
            chain.append(best)
        else:
            tok = int(rng.integers(0, pair.spec.vocab_size))
            chain.append(tok if tok != best else (tok + 1) % pair.spec.vocab_size)   # mismatch, then random
    return chain, min(keep, length)


def grow(pair, st: DecodeState, rng, rounds: int) -> tuple[DraftTree, list[int]]:
    """Random growth: each round adds 1-3 children under 1-3 fed alive nodes (mixed depths), feeds
    them in one forward, sometimes with a reviewed chain after one of them; some nodes stay unfed."""
    tree = drive(DraftTree.open(st, capacity=CAP))
    unfed: list[int] = []
    for _ in range(rounds):
        fed = [n for n in range(tree.size) if tree.fed(n) and tree.alive[n]]
        parents = rng.choice(fed, size=min(len(fed), int(rng.integers(1, 4))), replace=False)
        new = []
        for p in parents:
            have = set(tree.tokens[tree.children(int(p))].tolist())
            for _ in range(int(rng.integers(1, 4))):
                tok = int(rng.integers(0, pair.spec.vocab_size))
                if tok not in have:
                    have.add(tok)
                    new.append(tree.add(int(p), tok))
        if not new:
            continue
        rng.shuffle(new)
        hold = [n for n in new[1:] if rng.random() < 0.25]       # left unfed (leaves)
        batch = [n for n in new if n not in hold]
        unfed += hold
        chains, expect = {}, {}
        if rng.random() < 0.6:
            at = batch[int(rng.integers(0, len(batch)))]
            length = int(rng.integers(1, 5))
            chain, kept = review_chain(pair, st, tree, at, int(rng.integers(0, length + 1)), length, rng)
            chains[at], expect[at] = chain, kept
        size0 = tree.size
        done = drive(tree.feed(batch, chains))
        n_chain = sum(len(c) for c in chains.values())
        assert tree.size == size0 + n_chain
        kept_nodes = [n for n in range(size0, tree.size) if tree.alive[n]]
        assert done == batch + kept_nodes
        assert len(kept_nodes) == sum(expect.values())
    return tree, unfed


# ---------------------------------------------------------------------------------------------
# (a) draft distributions of fed nodes vs cache-free reference forwards
# ---------------------------------------------------------------------------------------------

@SETTINGS
@given(prompt=hst.lists(hst.sampled_from(ALPHABET), min_size=3, max_size=20), lag=hst.integers(1, 3),
       rounds=hst.integers(1, 5), seed=hst.integers(0, 2**31 - 1))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "phi3", "gemma3", "qwen3_moe"])
def test_fed_probs_equal_reference(arch_pairs, arch, prompt, lag, rounds, seed):
    pair = arch_pairs[arch]
    rng = np.random.default_rng(seed)
    st = make_state(pair, prompt, lag)
    tree, _ = grow(pair, st, rng, rounds)
    assert len(tree.forward_rows) <= rounds + 1
    assert assert_probs_match_reference(pair, st, tree) >= 1
    # token_tree(): exactly the alive nodes, same structure
    tt, sel = tree.token_tree()
    assert sel.tolist() == np.flatnonzero(tree.alive[: tree.size]).tolist()
    for i, n in enumerate(sel):
        assert int(tt.tokens[i]) == tree.tokens[n]
        assert (int(tt.parents[i]) == -1) if n == 0 else (sel[int(tt.parents[i])] == tree.parents[n])


def test_fed_probs_use_sampling_transform(llama_pair):
    """Under sampling, probs[node] is the draft's sampling distribution (temperature, top-k, top-p)."""
    st = make_state(llama_pair, [3, 17, 99, 3, 17], lag=2, sampling=TKP)
    tree, _ = grow(llama_pair, st, np.random.default_rng(5), 4)
    assert assert_probs_match_reference(llama_pair, st, tree) >= 3


# ---------------------------------------------------------------------------------------------
# (b) commit == fresh prefill; the next tree re-feeds what was not committed
# ---------------------------------------------------------------------------------------------

def committed_count(tree: DraftTree, path: np.ndarray) -> int:
    n = 0
    for node in path[1:]:
        if not tree.fed(node) or tree.borrowed[node]:
            break
        n += 1
    return n


@SETTINGS
@given(prompt=hst.lists(hst.sampled_from(ALPHABET), min_size=3, max_size=20), lag=hst.integers(1, 3),
       rounds=hst.integers(1, 4), seed=hst.integers(0, 2**31 - 1),
       end=hst.sampled_from(["fed", "unfed", "borrowed_copy", "borrowed_fed"]))
def test_commit_equals_fresh_prefill(llama_pair, prompt, lag, rounds, seed, end):
    pair = llama_pair
    rng = np.random.default_rng(seed)
    st = make_state(pair, prompt, lag)
    base = st.draft.cache.length
    tree, unfed = grow(pair, st, rng, rounds)
    fed = [n for n in range(1, tree.size) if tree.fed(n) and tree.alive[n]]
    if end == "fed" or (end == "unfed" and not unfed):
        target = max(fed, key=lambda n: tree.depth[n]) if fed else 0
        path = path_nodes(tree, target)
        expect = len(path) - 1
    elif end == "unfed":
        target = unfed[int(rng.integers(0, len(unfed)))]
        path = path_nodes(tree, target)
        expect = len(path) - 2                      # everything but the unfed leaf
    else:
        # a borrowed node under a fed node (GSD: a copy reached through a merged edge), with a child
        above = fed[int(rng.integers(0, len(fed)))] if fed else 0
        b = tree.add(above, int(rng.integers(0, pair.spec.vocab_size)), borrowed=True)
        if end == "borrowed_fed":                   # even when its KV row exists, it is not committed
            drive(tree.feed([b]))
            assert tree.fed(b)
        leaf = tree.add(b, int(rng.integers(0, pair.spec.vocab_size)))
        assert tree.borrowed[leaf], "a child of a borrowed node is borrowed"
        path = path_nodes(tree, leaf)
        expect = len(path_nodes(tree, above)) - 1   # stops right before the borrowed node
    assert committed_count(tree, path) == expect
    pending = len(tree.pending)
    st.draft.cache.commit(tree.proposal(list(path)).draft_commit(np.arange(len(path))))   # the shared step's commit
    committed = st.tokens().tolist() + tree.tokens[path[1:1 + expect]].tolist()
    assert st.draft.cache.length == base + pending + expect
    assert_cache_is_prefill(pair, st.draft, committed)

    # Next step: the sequence gains the whole accepted path + a bonus token; the new DraftTree
    # re-feeds the uncommitted tokens as pending and its root distribution is again exact.
    st.append(tree.tokens[path[1:]].tolist() + [ALPHABET[int(rng.integers(0, len(ALPHABET)))]])
    nxt = drive(DraftTree.open(st, capacity=CAP))
    assert nxt.pending == st.tokens()[len(committed):].tolist()
    torch.testing.assert_close(nxt.probs[0], ref_dist(pair, st, []), atol=ATOL, rtol=1e-4)


def test_commit_root_only_and_scratch_reset(llama_pair):
    st = make_state(llama_pair, [3, 17, 99, 250], lag=3)
    tree, _ = grow(llama_pair, st, np.random.default_rng(1), 3)
    assert st.draft.cache.scratch > 0
    st.draft.cache.commit(tree.proposal([0]).draft_commit(np.array([0])))
    assert_cache_is_prefill(llama_pair, st.draft, [3, 17, 99, 250])


def patch_step_checks(strat, monkeypatch) -> list[tuple[int, int]]:
    """Wrap the shared step for strat's requests: after each step the draft cache (no scratch left) must equal a fresh
    prefill of its prefix of the sequence, and lag it by 1 .. len(emitted) tokens (the committed
    rows are the pending tokens plus a prefix of the accepted path, never the bonus token)."""
    from trtspec.runtime import request as request_mod
    lags: list[tuple[int, int]] = []
    orig = request_mod.step

    def step(st, strategy):
        assert strategy is strat
        before = st.n_tokens - st.draft.cache.length          # tokens the draft has not seen yet
        emitted = yield from orig(st, strategy)
        seq = st.tokens().tolist() + emitted
        c = st.draft.cache
        assert c.scratch == 0
        lag = len(seq) - c.length
        if st.steps[-1].draft_forwards == 0:      # an ar step, or a suffix-only tree: the draft did not run
            assert lag == before + len(emitted)
        else:
            assert 1 <= lag <= len(emitted), f"draft cache lag {lag} after emitting {len(emitted)}"
        ref = ModelRunner.alone(st.draft.engine, CAP)
        drive(ref.prefill(seq[: c.length]))
        torch.testing.assert_close(c.buf[:, :, :, : c.length], ref.cache.buf[:, :, :, : c.length], atol=ATOL, rtol=1e-4)
        lags.append((lag, len(emitted)))
        return emitted

    monkeypatch.setattr(request_mod, "step", step)
    return lags


@pytest.mark.parametrize("strat", [Staged(), DySpec("heap"), DySpec("threshold", threshold=0.3),
                                   GSD(repeat=0, top_k=4, sibling_ratio=0.01, confidence=0.05, budget=32),
                                   GSD(repeat=1, top_k=4, sibling_ratio=0.01, confidence=0.05),
                                   Cascade(k_draft=3, k_mag=2, mag_len=6, lenience=3.0)],
                         ids=["staged", "dyspec-heap", "dyspec-threshold", "gsd-r0", "gsd-r1", "cascade"])
def test_draft_cache_after_every_step(llama_pair, small_pair, strat, monkeypatch):
    merged = 0
    runs = [(llama_pair, [3, 17] * 8), (llama_pair, [7] * 12), (small_pair, [1, 3, 5, 1, 3, 5, 1]),
            (small_pair, [2, 11, 2])]
    refs = [pair.generator(capacity=256).generate(prompt, strategy="ar", max_new_tokens=30).token_ids
            for pair, prompt in runs]
    lags = patch_step_checks(strat, monkeypatch)
    for (pair, prompt), ref in zip(runs, refs):
        res = pair.generator(capacity=256).generate(prompt, strategy=strat, max_new_tokens=30)
        assert res.token_ids == ref
        merged += sum(s.extra.get("merged_path", False) for s in res.steps)
    assert len(lags) > 20
    if strat.name == "gsd" and strat.repeat == 0:
        assert merged > 0, "no accepted merged path: the borrowed-node fix-up was not exercised"


# ---------------------------------------------------------------------------------------------
# (c) review semantics
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def reviewed(llama_pair):
    st = make_state(llama_pair, [3, 17, 99, 3, 17], lag=1)
    tree = drive(DraftTree.open(st, capacity=CAP))
    a = tree.add(0, 250)
    b = tree.add(0, 7)
    return llama_pair, st, tree, a, b


@pytest.mark.parametrize("keep,length", [(0, 1), (0, 4), (2, 5), (4, 4), (3, 3)])
def test_review_keeps_argmax_prefix(reviewed, keep, length):
    pair, st, tree, a, b = reviewed
    chain, _ = review_chain(pair, st, tree, a, keep, length, np.random.default_rng(keep * 10 + length))
    done = drive(tree.feed([a, b], {a: chain}))
    nodes = list(range(3, 3 + length))
    assert done == [a, b] + nodes[:keep]
    assert tree.reviewed == length and tree.review_kept == keep
    assert tree.alive[nodes[:keep]].all() and not tree.alive[nodes[keep:]].any()
    assert all(tree.fed(n) for n in nodes)               # dead nodes were fed speculatively too
    tt, sel = tree.token_tree()
    assert sel.tolist() == [0, a, b] + nodes[:keep]
    last = nodes[keep - 1] if keep else a
    assert tree.children(last).tolist() == []            # the dead continuation is not a child
    assert tree.from_review[nodes].all() and tree.reviewed_mask(sel) == [False] * 3 + [True] * keep
    assert_probs_match_reference(pair, st, tree)         # kept (and dead) chain nodes: exact probs


def test_review_lenience(reviewed):
    """A non-argmax chain token survives iff lenience > 1 and p(tok) * lenience >= max p."""
    pair, st, tree0, a, _ = reviewed
    p = ref_dist(pair, st, [250])
    top2 = p.topk(2)
    p1, p2 = float(top2.values[0]), float(top2.values[1])
    second = int(top2.indices[1])
    ratio = p1 / p2
    assert ratio > 1.0001
    lows = sorted(p.argsort()[:5].tolist())
    for lenience, kept in ((1.0, False), (ratio * 0.999, False), (ratio * 1.001, True), (1e9, True)):
        st2 = make_state(pair, [3, 17, 99, 3, 17], lag=1)
        tree = drive(DraftTree.open(st2, capacity=CAP))
        node = tree.add(0, 250)
        nxt = ref_argmax(pair, st2, [250, second])
        done = drive(tree.feed([node], {node: [second, nxt]}, lenience))
        if kept:        # the lenient token is kept, and the review goes on from its own distribution
            assert done == [node, 2, 3] and tree.alive[2:4].all()
        else:
            assert done == [node] and not tree.alive[2:4].any()
    # a token far below max / lenience is rejected even with a large lenience
    st3 = make_state(pair, [3, 17, 99, 3, 17], lag=1)
    tree = drive(DraftTree.open(st3, capacity=CAP))
    node = tree.add(0, 250)
    low = lows[0]
    assert float(p[low]) * 50 < p1
    assert drive(tree.feed([node], {node: [low]}, 50.0)) == [node]


# ---------------------------------------------------------------------------------------------
# (d) GSD: merge refusal, unrolling
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def hand_tree(llama_pair):
    """A DraftTree over prompt [..., 3] (root token 3) whose nodes are added by hand (never fed)."""
    st = make_state(llama_pair, [17, 99, 3], lag=1)
    return drive(DraftTree.open(st, capacity=64))


def test_match_refuses_ancestor_and_self(hand_tree):
    t = hand_tree
    a = t.add(0, 5)
    b = t.add(a, 6)
    for r in (0, 1, 2):
        g = GSD(repeat=r)
        assert g._match(t, b, 5, {}) == -1          # A is B's parent
        assert g._match(t, b, 6, {}) == -1          # B itself
        assert g._match(t, b, 3, {}) == -1          # the root (token 3) is everyone's ancestor
    c = t.add(0, 5)                                 # same token as A, not B's ancestor
    assert GSD(repeat=0)._match(t, b, 5, {}) == c
    assert GSD(repeat=1)._match(t, b, 5, {}) == -1  # preceding tokens differ (6 vs root 3)
    assert GSD(repeat=-1)._match(t, b, 5, {}) == -1  # merging off


def test_match_refuses_cycle(hand_tree):
    t = hand_tree
    x = t.add(0, 5)
    y = t.add(x, 6)
    z = t.add(0, 7)
    g = GSD(repeat=0)
    assert g._match(t, z, 5, {}) == x               # no merged edges yet: Z -> X is fine
    merged = {y: [z]}                               # Y -> Z merged: X -> Y -> Z
    assert GSD._reaches(t, x, z, merged) and not GSD._reaches(t, z, x, merged)
    assert g._match(t, z, 5, merged) == -1          # Z -> X would close X -> Y -> Z -> X
    # longer cycle through two merged edges: X -> Y => W -> V => Z, then Z -> X refused
    w = t.add(0, 8)
    v = t.add(w, 9)
    merged = {y: [w], v: [z]}
    assert GSD._reaches(t, x, z, merged)
    assert g._match(t, z, 5, merged) == -1
    # a dead candidate is never merged onto
    t.alive[x] = False
    assert g._match(t, z, 5, {}) == -1


def test_match_repeat_context(hand_tree):
    t = hand_tree
    a = t.add(0, 5)
    c = t.add(a, 9)                                 # ... 3, 5, 9
    b = t.add(0, 6)
    d = t.add(b, 5)                                 # ... 3, 6, 5 -> proposes 9
    assert GSD(repeat=0)._match(t, d, 9, {}) == c
    assert GSD(repeat=1)._match(t, d, 9, {}) == c   # 5 == 5
    assert GSD(repeat=2)._match(t, d, 9, {}) == -1  # 3 != 6
    e = t.add(0, 3)
    f = t.add(e, 5)                                 # ... 3, 3, 5 -> proposes 9: both 2 tokens match c's
    assert GSD(repeat=2)._match(t, f, 9, {}) == c
    assert GSD(repeat=3)._match(t, f, 9, {}) == -1  # c's context runs out at the root


def dag_out(tree: DraftTree, merged: dict[int, list[int]], size: int, g: int) -> list[int]:
    """Outgoing DAG edges of g: its real (alive, pre-unrolling) children, then its merged targets."""
    return [c for c in range(size) if tree.parents[c] == g and tree.alive[c]] + merged.get(g, [])


def dag_path_count(tree: DraftTree, merged: dict[int, list[int]], size: int) -> int:
    """Number of root paths (the empty one included) in the acyclic DAG; memoised, polynomial."""
    memo: dict[int, int] = {}

    def count(g: int) -> int:
        if g not in memo:
            memo[g] = 1 + sum(count(c) for c in dag_out(tree, merged, size, g))
        return memo[g]
    return count(0)


def dag_has_path(tree: DraftTree, merged: dict[int, list[int]], size: int, toks: tuple[int, ...]) -> bool:
    g = 0
    for t in toks:
        nxt = [c for c in dag_out(tree, merged, size, g) if int(tree.tokens[c]) == t]
        if len(nxt) != 1:
            return False
        g = nxt[0]
    return True


def dag_paths(tree: DraftTree, merged: dict[int, list[int]], size: int) -> set[tuple[int, ...]]:
    """Token strings of every root path in the DAG (real + merged edges), root excluded (only for
    DAGs with few paths: their number can grow exponentially with the merges)."""
    out: set[tuple[int, ...]] = set()

    def walk(g, prefix):
        out.add(prefix)
        for c in dag_out(tree, merged, size, g):
            walk(c, prefix + (int(tree.tokens[c]),))
    walk(0, ())
    return out


def check_unroll(tree: DraftTree, merged: dict[int, list[int]], keep: list[int], budget: int, size0: int) -> None:
    assert keep[0] == 0 and len(keep) <= budget + 1 and len(set(keep)) == len(keep)
    kept = set(keep)
    for n in keep[1:]:
        assert int(tree.parents[n]) in kept, "not ancestor-closed"
        assert (n >= size0) == tree.borrowed[n], "an original node was marked borrowed, or a copy not"
    for p in kept:
        toks = [int(tree.tokens[c]) for c in keep if tree.parents[c] == p]
        assert len(toks) == len(set(toks)), f"siblings under {p} repeat a token: {toks}"
    tt, sel = tree.token_tree(keep)
    assert sorted(keep) == sel.tolist()
    paths = {tuple(int(tree.tokens[m]) for m in np.flatnonzero(tree.anc[n, : tree.size])[1:]) for n in keep}
    assert len(paths) == len(keep), "two kept nodes share a prefix"
    for toks in paths:
        assert dag_has_path(tree, merged, size0, toks), f"the unrolled tree has a path the DAG does not: {toks}"
    total = dag_path_count(tree, merged, size0)
    if budget + 1 >= total:
        assert paths == dag_paths(tree, merged, size0), "budget allowed the full unrolling but paths are missing"
    else:
        assert len(keep) == budget + 1, "budget not used although the DAG has more paths"


def random_dag(tree: DraftTree, rng, n_nodes: int, n_merges: int) -> dict[int, list[int]]:
    """Random tree (distinct sibling tokens) + merged edges obeying GSD's rules: onto a node that
    is no ancestor-or-self, closes no cycle, and whose token is new among the parent's outgoing edges."""
    vocab = 6
    for _ in range(n_nodes):
        p = int(rng.integers(0, tree.size))
        have = {int(tree.tokens[c]) for c in tree.children(p)}
        free = [t for t in range(vocab) if t not in have]
        if free:
            tree.add(p, int(rng.choice(free)))
    merged: dict[int, list[int]] = {}
    for _ in range(n_merges * 4):
        if sum(map(len, merged.values())) >= n_merges or tree.size < 2:
            break
        p, m = int(rng.integers(0, tree.size)), int(rng.integers(1, tree.size))
        out = {int(tree.tokens[c]) for c in tree.children(p)} | {int(tree.tokens[x]) for x in merged.get(p, [])}
        if tree.anc[p, m] or int(tree.tokens[m]) in out or GSD._reaches(tree, m, p, merged):
            continue
        merged.setdefault(p, []).append(m)
    for node in range(tree.size):           # as in real drafting, a node with edges out was fed (here:
        tree.top.setdefault(node, tree.top[0])      # the root's distribution stands in for its own)
        tree.probs.setdefault(node, tree.probs[0])
    return merged


@settings(max_examples=60, deadline=None, database=None)
@given(seed=hst.integers(0, 2**31 - 1), n_nodes=hst.integers(0, 14), n_merges=hst.integers(0, 6),
       budget=hst.integers(1, 40))
def test_unroll_random_dags(llama_pair, seed, n_nodes, n_merges, budget):
    st = make_state(llama_pair, [17, 99, 3], lag=1)
    tree = drive(DraftTree.open(st, capacity=64 + 2 * budget))
    rng = np.random.default_rng(seed)
    merged = random_dag(tree, rng, n_nodes, n_merges)
    size0 = tree.size
    keep, values = GSD(budget=budget)._unroll(st, tree, merged)     # st's budget: fixed
    assert len(values) == len(keep) - 1
    check_unroll(tree, merged, keep, budget, size0)


def test_unroll_in_real_runs(llama_pair, small_pair, monkeypatch):
    """Every _unroll of real GSD drafting (many merges) passes the same checks, on an acyclic DAG."""
    orig = gsd_mod.GSD._unroll
    calls = {"n": 0, "merged": 0}

    def unroll(self, st, tree, merged):
        size0 = tree.size
        for p, ms in merged.items():                    # acyclic: no merged target reaches its source
            for m in ms:
                assert not GSD._reaches(tree, m, p, merged) and not tree.anc[p, m]
        keep, values = orig(self, st, tree, merged)
        check_unroll(tree, merged, keep, self.nodes, size0)
        assert len(values) == len(keep) - 1
        calls["n"] += 1
        calls["merged"] += sum(map(len, merged.values()))
        return keep, values

    monkeypatch.setattr(gsd_mod.GSD, "_unroll", unroll)
    for pair, prompt in ((llama_pair, [3, 17] * 6), (small_pair, [1, 3, 5, 1, 3])):
        gen = pair.generator(capacity=256)
        for r in (0, 1):
            for budget in (6, 32):
                gen.generate(prompt, strategy=GSD(repeat=r, top_k=4, sibling_ratio=0.01, confidence=0.05,
                                                  budget=budget), max_new_tokens=20)
    assert calls["n"] > 10 and calls["merged"] > 10, calls
