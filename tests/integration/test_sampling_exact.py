"""Lossless sampling: emitted tokens are exact samples from the target distribution.

Two levels:

* `verify_sampling` alone, on a root with leaf children and explicit target / proposal
  distributions (no model): the emitted token (the accepted child's, or the target's keyed draw)
  must be distributed exactly as the root's target row, for one sampled child, several
  deterministic children, siblings sampled without replacement, i.i.d. siblings and a sampled +
  deterministic mix, whatever q rows the tree claims (the keyed rule never reads them).
* End to end through `Generator.generate` on a tiny 16-token pair: the joint distribution of the
  first two generated tokens under `ar`, `chain` (sampled drafts, q rows) and `ngram`
  (deterministic drafts), at temperature 1 and with top-k + top-p, equals the one computed from the
  target's logits (cache-free reference forwards).

Each check is a chi-square goodness-of-fit test (p > 0.001 passes). Each has a deliberately broken
counterpart (recursive rejection without its residual update; a rule that accepts every draft)
that the same test must reject (p < 1e-6), so these tests are known to have the power to catch a
wrong acceptance rule.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from conftest import reference_logits
from trtspec.runtime import verify as verify_mod
from trtspec.runtime.drafters.ngram import MaxGram
from trtspec.runtime.sampling import SamplingParams, probs_from_logits
from trtspec.runtime.strategies import ChainSpeculative, NGramSpeculative
from trtspec.runtime.tree import TokenTree
from trtspec.runtime.verify import sampling_choice, verify_sampling
from lab.chisquare import chisquare_p  # noqa: F401 (the other tests import it from here)

PASS_P = 1e-3        # a correct rule must not be rejected at this level
REJECT_P = 1e-6      # a broken rule must be rejected at least this strongly


# ---------------------------------------------------------------------------------------------
# Statistics helpers
# ---------------------------------------------------------------------------------------------

def test_chisquare_p_is_scipy_s():
    """The one chi-square helper (lab/chisquare.py, torch only) against scipy's, with the
    same merging of small bins: counts drawn from the distribution and from a wrong one."""
    rng = np.random.default_rng(0)
    for k, n in ((16, 400), (200, 3000), (3, 50)):
        probs = rng.dirichlet(np.ones(k) * 0.5)
        for draw in (probs, np.roll(probs, 1)):
            counts = rng.multinomial(n, draw).astype(np.float64)
            exp = probs * n
            small = exp < 5.0
            obs_b, exp_b = list(counts[~small]), list(exp[~small])
            if small.any():
                obs_b.append(counts[small].sum())
                exp_b.append(exp[small].sum())
            want = float(stats.chisquare(np.asarray(obs_b), np.asarray(exp_b)).pvalue)
            assert chisquare_p(counts, probs) == pytest.approx(want, rel=1e-9, abs=1e-300)
    assert chisquare_p([0, 3], [1.0, 0.0]) == 0.0


def reference_probs(logits: torch.Tensor, sp: SamplingParams) -> np.ndarray:
    """Temperature, then top-k, then top-p (smallest prefix with mass >= top_p), in float64 numpy:
    written independently of `probs_from_logits`."""
    x = logits.double().numpy() / sp.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    if sp.top_k:
        keep[order[: sp.top_k]] = True
    else:
        keep[:] = True
    p = np.where(keep, p, 0.0)
    p /= p.sum()
    if sp.top_p < 1.0:
        cum = 0.0
        keep2 = np.zeros_like(keep)
        for i in order:
            if p[i] == 0 or cum >= sp.top_p:
                break
            keep2[i] = True
            cum += p[i]
        p = np.where(keep2, p, 0.0)
        p /= p.sum()
    return p


# ---------------------------------------------------------------------------------------------
# Broken acceptance rules (the tests must be able to fail)
# ---------------------------------------------------------------------------------------------

def as_choice(rule):
    """A (path, next token) rule as the step calls its sampling rule (`verify.sampling_choice`, which
    tests patch): [last accepted node, next token], which the step reads with its batch's."""
    def choice(tree: TokenTree, target_probs: torch.Tensor, key: tuple[int, int]) -> torch.Tensor:
        path, nxt = rule(tree, target_probs, key)
        return torch.tensor([int(path[-1]), int(nxt)])
    return choice


def verify_sampling_no_residual(tree: TokenTree, target_probs: torch.Tensor, key: tuple[int, int]):
    """WRONG: recursive rejection (min(1, p/q), p for deterministic children, draws from a generator
    seeded by the key) that never updates p after a rejection: the fallback is drawn from the
    unmodified target row."""
    gen = torch.Generator().manual_seed((key[0] * 1_000_003 + key[1]) % 2**63)
    kids = tree.children()
    node = 0
    while True:
        p = target_probs[node]
        moved = False
        for c in kids[node]:
            y = int(tree.tokens[c])
            q = None if tree.q is None or torch.isnan(tree.q[c, 0]) else tree.q[c]
            u = float(torch.rand((), generator=gen))
            if (q is None and u < float(p[y])) or (q is not None and u * float(q[y]) < float(p[y])):
                node, moved = c, True
                break
        if not moved:
            return tree.path(node), int(torch.multinomial(p, 1, generator=gen))


# ---------------------------------------------------------------------------------------------
# verify_sampling alone: a root with leaf children, explicit p and q
# ---------------------------------------------------------------------------------------------

P_ROOT = torch.tensor([0.10, 0.15, 0.30, 0.05, 0.25, 0.15])
Q_DRAFT = torch.tensor([0.45, 0.25, 0.15, 0.10, 0.05, 0.00])
VS = len(P_ROOT)
N_UNIT = 5000


def child_rows(n_children: int) -> torch.Tensor:
    """Target rows: root = P_ROOT; children rows arbitrary (only used for the bonus token)."""
    rows = torch.full((n_children + 1, VS), 1.0 / VS)
    rows[0] = P_ROOT
    return rows


def first_emitted(tree: TokenTree, rows: torch.Tensor, key: tuple[int, int], rule) -> int:
    path, nxt = rule(tree, rows, key)
    return int(tree.tokens[path[1]]) if len(path) > 1 else nxt


def draw_without_replacement(rng: np.random.Generator, q: np.ndarray, m: int) -> tuple[list[int], list[np.ndarray]]:
    """m distinct tokens drawn one by one from q, each from q renormalised after removing the
    earlier ones; returns the tokens and the distribution each was drawn from."""
    q = q.astype(np.float64).copy()
    toks, rows = [], []
    for _ in range(m):
        dist = q / q.sum()
        t = int(rng.choice(len(q), p=dist))
        toks.append(t)
        rows.append(dist)
        q[t] = 0.0
    return toks, rows


def run_unit_case(case: str, rule, n: int = N_UNIT, seed: int = 0, wrong_q: bool = False) -> float:
    """Emit n first tokens for one of the tree shapes; return the chi-square p-value vs P_ROOT."""
    rng = np.random.default_rng(seed)
    q_np = Q_DRAFT.double().numpy()
    m = {"one_sampled": 1, "deterministic": 3, "without_replacement": 3, "iid": 3, "mixed": 2}[case]
    tree = TokenTree(torch.zeros(m + 1, dtype=torch.int64), torch.tensor([-1] + [0] * m),
                     torch.full((m + 1, VS), float("nan")))
    rows = child_rows(m)
    counts = np.zeros(VS, dtype=np.int64)
    for trial in range(n):
        if case == "one_sampled":
            toks = [int(rng.choice(VS, p=q_np))]
            tree.q[1] = Q_DRAFT
        elif case == "deterministic":
            toks = [2, 0, 4]                     # NaN rows: verified with q = one-hot
        elif case == "without_replacement":
            toks, qrows = draw_without_replacement(rng, q_np, m)
            for i, r in enumerate(qrows):       # the broken variant claims the original q for all
                tree.q[i + 1] = Q_DRAFT if wrong_q else torch.from_numpy(r).float()
        elif case == "iid":
            toks = [int(t) for t in rng.choice(VS, size=m, p=q_np)]
            tree.q[1:] = Q_DRAFT
        elif case == "mixed":                   # a sampled child, then a deterministic one
            toks = [int(rng.choice(VS, p=q_np)), 4]
            tree.q[1] = Q_DRAFT
        tree.tokens[1:] = torch.tensor(toks)
        counts[first_emitted(tree, rows, (seed * 1_000_003 + trial, 17), rule)] += 1
    return chisquare_p(counts, P_ROOT.double().numpy())


UNIT_CASES = ["one_sampled", "deterministic", "without_replacement", "iid", "mixed"]


@pytest.mark.parametrize("case", UNIT_CASES)
def test_verify_sampling_exact(case):
    pval = run_unit_case(case, verify_sampling)
    print(f"[pvalue] unit {case}: {pval:.3g}")
    assert pval > PASS_P, f"{case}: emitted token not distributed as the target (p={pval:.3g})"


@pytest.mark.parametrize("case", ["one_sampled", "deterministic", "without_replacement", "mixed"])
def test_verify_sampling_broken_rule_is_detected(case):
    pval = run_unit_case(case, verify_sampling_no_residual, n=N_UNIT // 3, seed=100)
    print(f"[pvalue] unit broken no-residual {case}: {pval:.3g}")
    assert pval < REJECT_P, f"{case}: the no-residual rule was not detected (p={pval:.3g})"


def test_the_keyed_rule_never_reads_q():
    """Siblings drawn without replacement but claiming the original q (recursive rejection's classic
    bug: biased there) change nothing here: the root's token is the target's keyed draw."""
    pval = run_unit_case("without_replacement", verify_sampling, n=N_UNIT // 3, seed=200, wrong_q=True)
    print(f"[pvalue] unit un-renormalised q: {pval:.3g}")
    assert pval > PASS_P, f"the keyed rule depended on q (p={pval:.3g})"


def test_verify_sampling_path_and_bonus_row():
    """An accepted child's bonus token comes from that child's target row."""
    tree = TokenTree.chain(0, [3], torch.stack([torch.full((VS,), float("nan")), Q_DRAFT]))
    rows = child_rows(1)
    rows[0] = torch.nn.functional.one_hot(torch.tensor(3), VS).float()   # child always accepted
    rows[1] = torch.nn.functional.one_hot(torch.tensor(5), VS).float()   # bonus must be 5
    for s in range(20):
        path, nxt = verify_sampling(tree, rows, (s, 3))
        assert path.tolist() == [0, 1] and nxt == 5


def test_reference_probs_agree_with_runtime():
    g = torch.Generator().manual_seed(0)
    for sp in (SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8),
               SamplingParams(0.8, top_k=6, top_p=0.9)):
        logits = 3 * torch.randn(4, 16, generator=g)
        got = probs_from_logits(logits, sp).double().numpy()
        for r in range(4):
            np.testing.assert_allclose(got[r], reference_probs(logits[r], sp), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# End to end: first two generated tokens through Generator.generate
# ---------------------------------------------------------------------------------------------

T1 = SamplingParams(temperature=1.0)
TKP = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)


def exact_first_two(model, prompt: list[int], sp: SamplingParams) -> np.ndarray:
    """[V, V] joint distribution of the first two sampled tokens, from cache-free forwards."""
    p1 = reference_probs(reference_logits(model, prompt)[-1], sp)
    joint = np.zeros((len(p1), len(p1)))
    for t in np.flatnonzero(p1):
        joint[t] = p1[t] * reference_probs(reference_logits(model, prompt + [int(t)])[-1], sp)
    return joint


def sample_first(gen, prompt, strategy, sp: SamplingParams, n: int, seed0: int, ntok: int = 2,
                 together: int | None = None) -> np.ndarray:
    """Counts [V] * ntok of the first ntok tokens of n generations with seeds seed0, seed0 + 1, ...
    (through stop tokens, a grammar's aside: a generation that ended at one would count in a whole row),
    submitted `together` at a time (default: twice the slots), so the scheduler batches them: a
    request's draws are its own whatever shares its batch."""
    counts = np.zeros((gen.target_engine.spec.vocab_size,) * ntok, dtype=np.int64)
    window = together or 2 * len(gen.slots)
    for start in range(0, n, window):
        handles = [gen.submit(prompt, strategy=strategy, max_new_tokens=ntok, sampling=sp, seed=seed0 + i,
                              ignore_eos=sp.grammar is None) for i in range(start, min(n, start + window))]
        for h in handles:
            counts[tuple(h.result().token_ids)] += 1
    return counts


def fit(counts: np.ndarray, joint: np.ndarray) -> tuple[float, float]:
    """(p-value of the first token's marginal, p-value of the joint of the first two)."""
    return chisquare_p(counts.sum(1), joint.sum(1)), chisquare_p(counts, joint)


@pytest.fixture(scope="module")
def ngram_prompt(small_pair) -> list[int]:
    """A prompt [x, y, x] whose n-gram draft y has target probability in [0.3, 0.7]: the
    deterministic draft is accepted and rejected often."""
    best = None
    for x in range(16):
        for y in range(16):
            if x == y:
                continue
            p = reference_probs(reference_logits(small_pair.target, [x, y, x])[-1], T1)[y]
            if 0.3 <= p <= 0.7:
                best = [x, y, x]
                break
        if best:
            break
    assert best is not None
    assert MaxGram().propose(np.asarray(best), 2) == [best[1], best[2]]
    return best


CHAIN_PROMPT = [1, 2, 3, 4, 1, 2, 3]
SHORT_PROMPT = [7]       # no prefill forward: the cheap case, for the more expensive variants


def test_ar_first_two_tokens_exact(small_pair, small_gen):
    joint = exact_first_two(small_pair.target, SHORT_PROMPT, T1)
    p_first, p_joint = fit(sample_first(small_gen, SHORT_PROMPT, "ar", T1, 1000, 0), joint)
    print(f"[pvalue] e2e ar: first {p_first:.3g} joint {p_joint:.3g}")
    assert p_first > PASS_P and p_joint > PASS_P, (p_first, p_joint)


@pytest.mark.parametrize("prompt,sp,n", [(CHAIN_PROMPT, T1, 1500), (SHORT_PROMPT, TKP, 1200)],
                         ids=["t1", "topk_topp"])
def test_chain_first_two_tokens_exact(small_pair, small_gen, prompt, sp, n):
    joint = exact_first_two(small_pair.target, prompt, sp)
    counts = sample_first(small_gen, prompt, ChainSpeculative(2), sp, n, 10_000)
    p_first, p_joint = fit(counts, joint)
    print(f"[pvalue] e2e chain {sp}: first {p_first:.3g} joint {p_joint:.3g}")
    assert p_first > PASS_P and p_joint > PASS_P, (p_first, p_joint)


def test_ngram_first_two_tokens_exact(small_pair, small_gen, ngram_prompt):
    joint = exact_first_two(small_pair.target, ngram_prompt, T1)
    counts = sample_first(small_gen, ngram_prompt, NGramSpeculative(2), T1, 1500, 20_000)
    p_first, p_joint = fit(counts, joint)
    print(f"[pvalue] e2e ngram: first {p_first:.3g} joint {p_joint:.3g}")
    assert p_first > PASS_P and p_joint > PASS_P, (p_first, p_joint)


def test_chain_drafts_are_really_sampled_and_verified(small_gen, monkeypatch):
    """Sanity for the tests above: sampled drafts are accepted and rejected, and q rows exist."""
    seen_q = []

    def spy(tree, probs, key):
        seen_q.append(tree.q is not None and not bool(torch.isnan(tree.q[1:]).any()))
        return sampling_choice(tree, probs, key)

    monkeypatch.setattr(verify_mod, "sampling_choice", spy)
    acc = [s.accepted for i in range(40)
           for s in small_gen.generate(CHAIN_PROMPT, strategy=ChainSpeculative(2), max_new_tokens=6,
                                       sampling=T1, seed=i).steps]
    assert seen_q and all(seen_q)
    assert 0 in acc and max(acc) >= 1


def accept_every_draft(tree: TokenTree, target_probs: torch.Tensor, key: tuple[int, int]):
    """WRONG: follows each node's first child down to a leaf, then the target's keyed draw."""
    kids, node = tree.children(), 0
    while kids[node]:
        node = kids[node][0]
    return tree.path(node), int(verify_mod.drawn(tree, target_probs, key)[node])


@pytest.mark.parametrize("which", ["chain", "ngram"])
def test_broken_rule_is_detected_end_to_end(small_pair, small_gen, ngram_prompt, monkeypatch, which):
    """The same end-to-end check on the first generated token, with a rule that accepts every draft
    patched in where the step calls its sampling rule: it must be rejected."""
    monkeypatch.setattr(verify_mod, "sampling_choice", as_choice(accept_every_draft))
    prompt, strategy, n = ((SHORT_PROMPT, ChainSpeculative(1), 600) if which == "chain"
                           else (ngram_prompt, NGramSpeculative(2), 600))
    p1 = reference_probs(reference_logits(small_pair.target, prompt)[-1], T1)
    p_first = chisquare_p(sample_first(small_gen, prompt, strategy, T1, n, 30_000, ntok=1), p1)
    print(f"[pvalue] e2e broken accept-every-draft {which}: first {p_first:.3g}")
    assert p_first < REJECT_P, f"{which}: the broken rule was not detected (first-token p={p_first:.3g})"
