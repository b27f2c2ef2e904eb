"""verify_greedy on hand-built and random trees; sampled verification by keyed draws; KVCache.commit
compaction; tree commit end to end; verification that reads the device once per step."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from conftest import reference_logits
from trtspec.export.tiny import tiny_spec
from trtspec.runtime import verify as verify_mod
from trtspec.runtime.decode import DecodeState
from trtspec.runtime.kv_cache import KVCache, KVPool
from trtspec.runtime.proposal import Proposal
from trtspec.runtime.effects import drive
from trtspec.runtime.runner import ModelRunner
from trtspec.runtime.sampling import SamplingParams, probs_from_logits
from trtspec.runtime.step import verify_and_commit
from trtspec.runtime.strategies import STRATEGIES
from trtspec.runtime.tree import TokenTree
from trtspec.runtime.effects import Check
from trtspec.runtime.sampling import inverse_cdf, keyed_uniforms
from trtspec.runtime.verify import choose_together, greedy_choice, sampling_choice, verify_greedy
from lab.host_reads import HostReads
from lab.host_reads import count as count_host_reads
from lab.host_reads import count_batch

V = 8


def logits_with_argmax(argmaxes: list[int], vocab: int = V, seed: int = 0) -> torch.Tensor:
    """[N, vocab] random logits whose row i has its (unique) maximum at argmaxes[i]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(len(argmaxes), vocab, generator=g)
    x[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 2.0
    return x


def tree_of(tokens: list[int], parents: list[int]) -> TokenTree:
    return TokenTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# verify_greedy, hand-built trees
# ---------------------------------------------------------------------------------------------

def test_greedy_accepts_nothing():
    tree = TokenTree.chain(3, [1, 2])
    path, nxt = verify_greedy(tree, logits_with_argmax([5, 2, 0]))   # target wants 5, draft said 1
    assert path.tolist() == [0] and nxt == 5


def test_greedy_partial_chain():
    tree = TokenTree.chain(3, [1, 2, 4])
    path, nxt = verify_greedy(tree, logits_with_argmax([1, 6, 4, 7]))   # 1 ok, then 6 != 2
    assert path.tolist() == [0, 1] and nxt == 6


def test_greedy_full_chain_bonus_token():
    tree = TokenTree.chain(3, [1, 2, 4])
    path, nxt = verify_greedy(tree, logits_with_argmax([1, 2, 4, 7]))
    assert path.tolist() == [0, 1, 2, 3] and nxt == 7      # the leaf's own argmax is the bonus


def test_greedy_one_node_tree_is_autoregressive():
    path, nxt = verify_greedy(TokenTree.chain(3, []), logits_with_argmax([6]))
    assert path.tolist() == [0] and nxt == 6


def test_greedy_matching_branch_is_second_child():
    #            0 (root)
    #         /     \
    #      1:tok4   2:tok5            target argmax at root = 5 -> node 2
    #      /  \        |
    #  3:tok0 4:tok1  5:tok6          at node 2 argmax = 6 -> node 5
    #    |             |
    #  6:tok2        7:tok3           at node 5 argmax = 7 (mismatch: node 7 rejected)
    # The decoy subtree under node 1 matches its own parents' argmaxes but node 1 itself does not,
    # so none of it may survive.
    tokens = [9, 4, 5, 0, 1, 6, 2, 3]
    parents = [-1, 0, 0, 1, 1, 2, 3, 5]
    argmax = [5, 0, 6, 2, 0, 7, 0, 0]
    path, nxt = verify_greedy(tree_of(tokens, parents), logits_with_argmax(argmax))
    assert path.tolist() == [0, 2, 5] and nxt == 7


def test_greedy_deepest_branch_wins_to_leaf():
    tokens = [9, 4, 5, 6, 1]
    parents = [-1, 0, 0, 2, 3]      # node 1 a leaf sibling; 2 -> 3 -> 4 a chain
    path, nxt = verify_greedy(tree_of(tokens, parents), logits_with_argmax([5, 0, 6, 1, 3]))
    assert path.tolist() == [0, 2, 3, 4] and nxt == 3


# ---------------------------------------------------------------------------------------------
# verify_greedy vs a naive walk on random trees
# ---------------------------------------------------------------------------------------------

@hst.composite
def random_tree_and_logits(draw):
    n = draw(hst.integers(1, 24))
    parents = [-1] + [draw(hst.integers(max(0, i - 4), i - 1)) for i in range(1, n)]
    # Siblings carry distinct tokens (the invariant verify_greedy relies on).
    tokens = [draw(hst.integers(0, V - 1))]
    used: dict[int, set[int]] = {}
    for i in range(1, n):
        taken = used.setdefault(parents[i], set())
        free = [t for t in range(V) if t not in taken]
        if not free:               # parent already has V children: re-hang under the root's chain
            parents[i] = i - 1
            taken = used.setdefault(parents[i], set())
            free = [t for t in range(V) if t not in taken]
        tok = draw(hst.sampled_from(free))
        taken.add(tok)
        tokens.append(tok)
    # Bias the argmaxes towards a child's token so long accepted paths happen.
    kids: dict[int, list[int]] = {}
    for i in range(1, n):
        kids.setdefault(parents[i], []).append(tokens[i])
    argmax = []
    for i in range(n):
        if kids.get(i) and draw(hst.booleans()) | draw(hst.booleans()):
            argmax.append(draw(hst.sampled_from(kids[i])))
        else:
            argmax.append(draw(hst.integers(0, V - 1)))
    return tokens, parents, argmax, draw(hst.integers(0, 2**31 - 1))


def naive_greedy(tokens, parents, logits):
    node, path = 0, [0]
    while True:
        best = int(logits[node].argmax())
        nxt = [c for c in range(len(tokens)) if parents[c] == node and tokens[c] == best]
        if not nxt:
            return path, best
        node = nxt[0]
        path.append(node)


@settings(max_examples=200, deadline=None, database=None)
@given(random_tree_and_logits())
def test_greedy_matches_naive_walk(case):
    tokens, parents, argmax, seed = case
    logits = logits_with_argmax(argmax, seed=seed)
    path, nxt = verify_greedy(tree_of(tokens, parents), logits)
    ref_path, ref_nxt = naive_greedy(tokens, parents, logits)
    assert path.tolist() == ref_path
    assert nxt == ref_nxt


# ---------------------------------------------------------------------------------------------
# KVCache.commit
# ---------------------------------------------------------------------------------------------

def labelled_cache(length: int, scratch: int, capacity: int = 16) -> KVCache:
    """A cache whose row r holds the value r everywhere (plus a per-layer/kv offset)."""
    spec = tiny_spec(num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2)
    cache = KVPool(spec, 1, capacity, torch.float32).caches[0]
    L, _, H, S, D = cache.buf.shape
    rows = torch.arange(S, dtype=torch.float32).view(1, 1, 1, S, 1)
    offset = 1000 * torch.arange(L * 2, dtype=torch.float32).view(L, 2, 1, 1, 1)
    cache.buf.copy_((rows + offset).expand(L, 2, H, S, D))
    cache.length = length
    cache.advance(scratch)
    return cache


def row_labels(cache: KVCache) -> list[int]:
    return cache.buf[0, 0, 0, :, 0].long().tolist()


def test_commit_non_prefix_rows_are_compacted():
    cache = labelled_cache(length=3, scratch=6)
    before = cache.buf.clone()
    ptr = cache.buf.data_ptr()
    cache.commit([0, 2, 5])
    assert cache.length == 6 and cache.scratch == 0 and cache.used == 6
    # Committed prefix untouched; scratch rows 3+0, 3+2, 3+5 now sit at rows 3, 4, 5.
    assert torch.equal(cache.buf[:, :, :, :3], before[:, :, :, :3])
    assert torch.equal(cache.buf[:, :, :, 3:6], before[:, :, :, [3, 5, 8]])
    assert row_labels(cache)[:6] == [0, 1, 2, 3, 5, 8]
    assert cache.buf.data_ptr() == ptr                 # compacted in place
    # Every layer and K/V plane moved the same way.
    L = cache.buf.shape[0]
    for l in range(L):
        for j in (0, 1):
            assert cache.buf[l, j, 1, 3:6, 0].tolist() == [1000 * (2 * l + j) + r for r in (3, 5, 8)]


def test_commit_prefix_fast_path_does_not_write():
    cache = labelled_cache(length=4, scratch=5)
    before = cache.buf.clone()
    version = cache.buf._version
    cache.commit(np.array([0, 1, 2]))
    assert cache.length == 7 and cache.scratch == 0
    assert torch.equal(cache.buf, before)
    assert cache.buf._version == version, "a prefix commit should not copy any rows"


def test_commit_accepts_range_and_empty():
    cache = labelled_cache(length=2, scratch=4)
    cache.commit(range(3))
    assert cache.length == 5 and cache.scratch == 0
    cache.advance(3)
    cache.commit([])
    assert cache.length == 5 and cache.scratch == 0
    assert row_labels(cache)[:5] == [0, 1, 2, 3, 4]


def test_commit_single_non_prefix_row():
    cache = labelled_cache(length=0, scratch=4)
    cache.commit([3])
    assert cache.length == 1 and row_labels(cache)[0] == 3


@settings(max_examples=100, deadline=None, database=None)
@given(hst.integers(0, 6), hst.data())
def test_commit_random_subsets(length, data):
    scratch = data.draw(hst.integers(0, 9))
    rows = sorted(data.draw(hst.sets(hst.integers(0, max(scratch - 1, 0)), max_size=scratch)))
    cache = labelled_cache(length=length, scratch=scratch)
    cache.commit(rows)
    assert cache.length == length + len(rows) and cache.scratch == 0
    assert row_labels(cache)[:cache.length] == list(range(length)) + [length + r for r in rows]


# ---------------------------------------------------------------------------------------------
# Tree verification + commit end to end: the KV kept from a tree equals a plain prefill's
# ---------------------------------------------------------------------------------------------

def test_tree_commit_matches_plain_prefill(llama_pair):
    engine, model = llama_pair.target_engine, llama_pair.target
    vocab = llama_pair.spec.vocab_size
    prompt = [11, 42, 7, 300, 42, 7]
    ctx = reference_logits(model, prompt)[-1]
    a = int(ctx.argmax())
    b = int(reference_logits(model, prompt + [a])[-1].argmax())
    c = int(reference_logits(model, prompt + [a, b])[-1].argmax())
    decoy = (a + 1) % vocab
    #   0:root ─┬─ 1:decoy ── 2:b
    #           └─ 3:a ─┬─ 4:(b+1)
    #                   └─ 5:b ── 6:(c+1)        accepted path: 0, 3, 5; correction = c
    tokens = [prompt[-1], decoy, b, a, (b + 1) % vocab, b, (c + 1) % vocab]
    parents = [-1, 0, 1, 0, 3, 3, 5]
    tree = tree_of(tokens, parents)

    runner = ModelRunner.alone(engine, 64)
    drive(runner.prefill(prompt[:-1]))
    seq = np.zeros(64, dtype=np.int64)
    st = DecodeState(runner, None, SamplingParams(), seq, 0)
    st.append(prompt)
    out = drive(verify_and_commit(st, Proposal(tree)))
    emitted = out[0] if isinstance(out, tuple) else out      # (emitted, path) in newer versions
    assert emitted == [a, b, c]
    if isinstance(out, tuple):
        assert list(out[1]) == [0, 3, 5]
    assert runner.cache.length == len(prompt) + 2 and runner.cache.scratch == 0

    ref = ModelRunner.alone(engine, 64)
    drive(ref.prefill(prompt + [a, b]))
    n = ref.cache.length
    assert n == runner.cache.length
    torch.testing.assert_close(runner.cache.buf[:, :, :, :n], ref.cache.buf[:, :, :, :n], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Verification stays on the device: one host read per step
# ---------------------------------------------------------------------------------------------

def random_tree(data, vocab: int, sampled: bool) -> TokenTree:
    """A random tree whose siblings carry distinct tokens; with `sampled`, a mix of q rows and NaN
    (deterministic) rows."""
    n = data.draw(hst.integers(1, 24))
    parents = [-1] + [data.draw(hst.integers(0, i - 1)) for i in range(1, n)]
    tokens = [data.draw(hst.integers(0, vocab - 1))]
    for i in range(1, n):
        used = {tokens[j] for j in range(1, i) if parents[j] == parents[i]}
        tokens.append(data.draw(hst.sampled_from([t for t in range(vocab) if t not in used])))
    q = None
    if sampled:
        g = torch.Generator().manual_seed(data.draw(hst.integers(0, 2**16)))
        q = torch.softmax(torch.randn(n, vocab, generator=g), -1)
        q[[0] + [i for i in range(1, n) if data.draw(hst.booleans())]] = float("nan")
    return TokenTree(tokens, parents, q)


@settings(max_examples=40, deadline=None, database=None)
@given(hst.data())
def test_verification_reads_the_device_once(data):
    vocab = 32                            # more than the most siblings a tree here can have
    tree = random_tree(data, vocab, sampled=data.draw(hst.booleans()))
    g = torch.Generator().manual_seed(data.draw(hst.integers(0, 2**16)))
    logits = torch.randn(len(tree), vocab, generator=g) * 3
    params = SamplingParams(temperature=0.9, top_k=data.draw(hst.sampled_from([0, 5])),
                            top_p=data.draw(hst.sampled_from([1.0, 0.8])))
    with HostReads() as reads:
        path, nxt = verify_greedy(tree, logits)
    assert reads.reads == ["tolist"]
    assert 0 <= nxt < vocab and path[0] == 0
    with HostReads() as reads:
        probs = probs_from_logits(logits, params)
        last, nxt = sampling_choice(tree, probs, (data.draw(hst.integers(0, 2**40)), 9)).tolist()
    assert reads.reads == ["tolist"]
    path = tree.path(last)
    assert 0 <= nxt < vocab and path[0] == 0 and (len(path) == 1 or tree.host_parents[path[-1]] == path[-2])


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_target_step_reads_the_device_once(llama_pair, sampled):
    """A whole verify step (mask, positions, forward, acceptance, KV commit): one host read, the
    accepted node and next token. The engine's own forward is not counted (a CUDA graph replays it:
    the batcher's hooks pause the count)."""
    engine = llama_pair.target_engine
    reads = HostReads()
    runner = ModelRunner.alone(engine, 64, hooks=reads)
    prompt = [11, 42, 7, 300, 42, 7]
    drive(runner.prefill(prompt[:-1]))
    seq = np.zeros(64, dtype=np.int64)
    params = SamplingParams(temperature=0.8, top_k=50) if sampled else SamplingParams()
    st = DecodeState(runner, None, params, seq, 0)
    st.append(prompt)
    vocab = llama_pair.spec.vocab_size
    q = torch.softmax(torch.randn(6, vocab, generator=torch.Generator().manual_seed(1)), -1) if sampled else None
    if q is not None:
        q[[0, 3]] = float("nan")
    tree = TokenTree([7, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 2], q)
    with reads:                                        # batched: as on a GPU, the batched walk, no early exit
        emitted, path = drive(verify_and_commit(st, Proposal(tree)), batched=True)
    assert reads.reads == ["tolist"]
    assert runner.cache.length == len(prompt) - 1 + len(path) and emitted[:-1] == tree.host_tokens[path[1:]].tolist()


def naive_sampled(tree: TokenTree, probs: torch.Tensor, seed: int, start: int) -> list[int]:
    """Walk down from the root: draw the target's token at the node (inverse CDF of its row alone, in
    float64 numpy, at the uniform keyed by (seed, start + depth)); move to the child carrying it, if
    any; else that is the next token."""
    node, depth = 0, 0
    while True:
        u = keyed_uniforms(seed, np.array([start + depth]))[0]
        cdf = np.cumsum(probs[node].double().numpy())
        x = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), int((cdf < cdf[-1]).sum()))
        kids = [c for c in tree.children()[node] if tree.host_tokens[c] == x]
        if not kids:
            return [node, x]
        node, depth = kids[0], depth + 1


@settings(max_examples=60, deadline=None, database=None)
@given(hst.data())
def test_a_sampled_choice_walks_the_keyed_draws(data):
    """The sampled choice is the naive walk down the target's keyed draws (one per depth), and a
    node's draw is its own row's, with its position's uniform, whatever tree holds it."""
    vocab = 32
    tree = random_tree(data, vocab, sampled=data.draw(hst.booleans()))
    g = torch.Generator().manual_seed(data.draw(hst.integers(0, 2**16)))
    probs = probs_from_logits(leaning_logits(tree, vocab, g), SamplingParams(temperature=1.0))
    seed, start = data.draw(hst.integers(0, 2**63 - 1)), data.draw(hst.integers(0, 5000))
    assert sampling_choice(tree, probs, (seed, start)).tolist() == naive_sampled(tree, probs, seed, start)
    node = data.draw(hst.integers(0, len(tree) - 1))
    alone = inverse_cdf(probs[node:node + 1], torch.tensor(keyed_uniforms(seed, [start + tree.host_depth[node]])))
    assert int(alone) == int(verify_mod.drawn(tree, probs, (seed, start))[node])


def test_keyed_draws_are_exact_samples():
    """Over seeds, the keyed draw at a position is distributed as the row it inverts (chi-square),
    and the draws of two positions are independent (their joint counts)."""
    from lab.chisquare import chisquare_p
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05, 0.0]])
    n = 20000
    first = [int(inverse_cdf(p, torch.tensor(keyed_uniforms(s, [7])))) for s in range(n)]
    second = [int(inverse_cdf(p, torch.tensor(keyed_uniforms(s, [8])))) for s in range(n)]
    assert chisquare_p(np.bincount(first, minlength=6), p[0].numpy()) > 1e-3
    joint = np.bincount(np.array(first) * 6 + np.array(second), minlength=36)
    assert chisquare_p(joint, np.outer(p[0].numpy(), p[0].numpy()).ravel()) > 1e-3
    shifted = [int(inverse_cdf(p, torch.tensor(keyed_uniforms(s, [7])))) for s in range(1, n + 1)]
    assert chisquare_p(np.bincount(np.array(first) * 6 + np.array(shifted), minlength=36),
                       np.outer(p[0].numpy(), p[0].numpy()).ravel()) > 1e-3      # neighbouring seeds too
    assert chisquare_p(np.bincount(first, minlength=6), np.roll(p[0].numpy(), 1)) < 1e-6   # the test has power


def leaning_logits(tree: TokenTree, vocab: int, g: torch.Generator) -> torch.Tensor:
    """Random logits whose argmax at a node is often one of its children's tokens (long greedy paths)."""
    x = torch.randn(len(tree), vocab, generator=g)
    for node, kids in enumerate(tree.children()):
        if kids and torch.rand(1, generator=g) < 0.7:
            x[node, tree.host_tokens[kids[int(torch.randint(len(kids), (1,), generator=g))]]] = 10.0
    return x


@settings(max_examples=40, deadline=None, database=None)
@given(hst.data())
def test_a_batch_is_chosen_as_each_tree_alone(data):
    """A phase's verifications chosen together (all trees' flattened nodes in one pass, or tree by
    tree as the CPU runs them) give every request what its tree alone gives (greedy_choice, or
    sampling_choice with its key): neither a neighbour nor the batch's size changes a request's draws."""
    vocab = 32
    checks, alone = [], []
    for _ in range(data.draw(hst.integers(1, 11))):
        sampled = data.draw(hst.booleans())
        tree = random_tree(data, vocab, sampled=sampled and data.draw(hst.booleans()))
        g = torch.Generator().manual_seed(data.draw(hst.integers(0, 2**16)))
        logits = leaning_logits(tree, vocab, g)
        if not sampled:
            checks.append(Check(tree, logits, None))
            alone.append(greedy_choice(tree, logits).tolist())
            continue
        probs = probs_from_logits(logits, SamplingParams(temperature=data.draw(hst.sampled_from([0.5, 1.0, 1.5]))))
        key = (data.draw(hst.integers(0, 2**16)), data.draw(hst.integers(0, 100)))
        alone.append(sampling_choice(tree, probs, key).tolist())
        checks.append(Check(tree, probs, key))
    for batched in (True, False):
        assert choose_together(checks, batched=batched).tolist() == alone, batched


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_verifies_with_one_read_per_step(llama_pair, name):
    """Through each strategy's own steps (drafting included), greedy and sampled: verification reads
    the device once per target step (what drafting reads is counted, not bounded: docs/benchmarks.md)."""
    for sp in (SamplingParams(), SamplingParams(temperature=0.8)):
        row = count_host_reads(name, sp, llama_pair.target_engine, llama_pair.draft_engine, tokens=12)
        assert row["steps"] > 0 and row["verify_reads_per_step"] == 1.0, row


@pytest.mark.parametrize("name", ["chain", "staged"])
def test_a_batch_verifies_with_one_read_per_target_phase(llama_pair, name):
    """Three requests at once through the scheduler, observed through its hooks (lab/host_reads.py,
    runtime/hooks.py): every target phase that verified trees read the device once for all of them,
    and the engines' forwards were left out of the count."""
    for sp in (SamplingParams(), SamplingParams(temperature=0.8)):
        row = count_batch(name, sp, llama_pair.target_engine, llama_pair.draft_engine, tokens=10, batch=3)
        assert row["target_phases"] > 0 and row["draft_rounds"] > 0, row
        assert row["verify_reads_per_phase"] == 1.0, row
