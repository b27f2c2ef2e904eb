"""Lossless sampling for every tree strategy: emitted tokens are exact samples from the target.

On the 16-token tiny pair (draft at total-variation distance ~0.2-0.5 from the target), the joint
distribution of the first two generated tokens (N generations with distinct seeds) is compared by
chi-square with the exact one computed from cache-free target forwards (p > 1e-3 passes):

* dyspec (heap and threshold): children sampled WITHOUT replacement, each with q = the residual it
  was drawn from (checked structurally too: a sibling's q row is the previous one with the previous
  token removed, renormalised);
* staged, gsd (with merges), cascade (lenience 1 and 3, with a bigram table): deterministic children,
  verified with q = one-hot (no q rows at all);
* one top-k + top-p case for dyspec and gsd.

A broken variant that the same machinery must reject (p < 1e-6): for a deterministic-children
strategy, recursive rejection skipping the residual update after a rejection. And the keyed rule's
own promise: a seeded request's tokens are its `ar` tokens under every strategy, alone or batched,
whatever q rows its tree claims (dyspec recording the original draft distribution changes nothing).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import CPU_LIKE, GPU_LIKE, SMALL_VOCAB, reference_logits
from test_sampling_exact import chisquare_p, exact_first_two, fit, reference_probs, sample_first
from test_sampling_exact import as_choice, verify_sampling_no_residual
from trtspec.runtime import verify as verify_mod
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import GSD, Cascade, ChainSpeculative, DySpec, Staged, SuffixSpeculative
from trtspec.runtime.strategies import dyspec as dyspec_mod
from trtspec.runtime.verify import sampling_choice

PASS_P = 1e-3
REJECT_P = 1e-6
T1 = SamplingParams(temperature=1.0)
TKP = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
PROMPT = [1, 2, 3, 4, 1, 2, 3]     # repetitive: n-gram / MaG proposals and GSD merges fire
SHORT = [7]
N = 800


def make(name: str, bigram: str | None = None):
    return {
        "staged": lambda: Staged(budget=6, width=3, top_k=3, max_rounds=3, stage2=True, stage2_len=3),
        "staged-mixed": lambda: Staged(budget=6, width=3, top_k=3, max_rounds=3, stage2_len=3, suffix=True, scope=""),
        "dyspec-heap": lambda: DySpec("heap", budget=6, batch=3, max_depth=3),
        "dyspec-threshold": lambda: DySpec("threshold", budget=6, threshold=0.1, max_depth=3),
        "gsd": lambda: GSD(top_k=3, sibling_ratio=0.05, confidence=0.05, repeat=0, budget=8, max_depth=3,
                           max_draft_nodes=16),
        "cascade": lambda: Cascade(k_draft=2, k_mag=2, mag_len=3),
        "cascade-lenient-bigram": lambda: Cascade(k_draft=2, k_mag=2, mag_len=3, lenience=3.0, bigram=bigram),
        # budget auto (runtime/budget/) under GPU-like step costs (AUTO_COSTS): each step's tree depends on
        # the acceptance of the steps before it, which verification must not notice
        "staged-auto": lambda: Staged(max_budget=6, width=3, top_k=3, max_rounds=3, stage2=True, stage2_len=3),
        "dyspec-heap-auto": lambda: DySpec("heap", max_budget=6, batch=3, max_depth=3),
        "cascade-auto": lambda: Cascade(max_k_draft=2, k_mag=2, mag_len=3),
        "gsd-auto": lambda: GSD(top_k=3, sibling_ratio=0.05, confidence=0.05, repeat=0, max_budget=8, max_depth=3,
                                max_draft_nodes=16),
        # CPU-like costs: the policy cuts chains and trees short, often after one node; a cut decided by
        # the sampled token itself would bias the output (Values.drawn: decided before the draw)
        "chain-auto-cpu": lambda: ChainSpeculative(max_k=3),
        "dyspec-heap-auto-cpu": lambda: DySpec("heap", max_budget=6, batch=2, max_depth=3),
        # suffix tries: the request's own history, then with a global trie that every earlier sample fed
        # (each run's tree depends on the runs before it; verification must not notice)
        "suffix": lambda: SuffixSpeculative(budget=6, width=3, min_prob=0.01, scope=""),
        "suffix-global-auto": lambda: SuffixSpeculative(max_budget=6, width=3, min_prob=0.01, scope="chi-square"),
        # mixed trees: suffix and draft candidates in one tree, or a suffix-only step, by the budget
        "staged-mixed-auto": lambda: Staged(max_budget=6, width=3, top_k=3, max_rounds=3, stage2_len=3,
                                            suffix=True, scope="chi-square-staged"),
        "cascade-suffix": lambda: Cascade(k_draft=2, k_mag=2, mag_len=3, suffix=True, scope="chi-square-cascade"),
    }[name]()


@pytest.fixture(scope="module")
def bigram(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bigram") / "bigram16.npy"
    np.save(path, np.random.default_rng(3).integers(0, SMALL_VOCAB, size=SMALL_VOCAB, dtype=np.int64))
    return str(path)


class Spy:
    """Wraps the step's sampling rule (verify.sampling_choice): records which trees carried q rows and
    checks every q row."""

    def __init__(self):
        self.trees = self.sampled = self.merges = 0

    def __call__(self, tree, probs, key):
        self.trees += 1
        if tree.q is not None and not bool(torch.isnan(tree.q[1:]).all()):
            self.sampled += 1
            kids = tree.children()
            for node in range(len(tree)):
                prev = None
                for c in kids[node]:
                    q = tree.q[c].double()
                    assert not torch.isnan(q).any(), "a sampled tree has a deterministic child"
                    assert abs(float(q.sum()) - 1) < 1e-5 and q[int(tree.tokens[c])] > 0
                    if prev is not None:           # without replacement: residual of the previous sibling
                        expect = tree.q[prev].double().clone()
                        expect[int(tree.tokens[prev])] = 0
                        torch.testing.assert_close(q, expect / expect.sum(), atol=1e-5, rtol=1e-4)
                    prev = c
        return sampling_choice(tree, probs, key)


def run_case(small_pair, small_gen, monkeypatch, strat_name, sp, prompt, n, seed0, bigram=None):
    spy = Spy()
    monkeypatch.setattr(verify_mod, "sampling_choice", spy)
    monkeypatch.setattr(small_gen, "costs", CPU_LIKE if strat_name.endswith("-cpu") else GPU_LIKE)
    strat = make(strat_name, bigram)
    # CPU-like costs price a crowded batch's drafting away (ar steps): those cases run one at a time,
    # so that the policy's cut of a drafted tree is what they sample through
    counts = sample_first(small_gen, prompt, strat, sp, n, seed0, together=1 if strat_name.endswith("-cpu") else None)
    joint = exact_first_two(small_pair.target, prompt, sp)
    return fit(counts, joint), spy, strat


def acceptance(small_gen, strat, sp, prompt, runs: int = 25) -> tuple[list[int], int, int, set]:
    accepted, merges, merged_paths, mixed = [], 0, 0, set()
    for i in range(runs):
        res = small_gen.generate(prompt, strategy=strat, max_new_tokens=5, sampling=sp, seed=900_000 + i)
        accepted += [s.accepted for s in res.steps]
        merges += sum(s.extra.get("merges", 0) for s in res.steps)
        merged_paths += sum(s.extra.get("merged_path", False) for s in res.steps)
        mixed |= {frozenset(s.extra.get("sources", {})) for s in res.steps}
    return accepted, merges, merged_paths, mixed


CASES = [("staged", T1, PROMPT), ("dyspec-heap", T1, PROMPT), ("dyspec-threshold", T1, PROMPT),
         ("gsd", T1, PROMPT), ("cascade", T1, PROMPT), ("cascade-lenient-bigram", T1, PROMPT),
         ("dyspec-heap", TKP, SHORT), ("gsd", TKP, SHORT),
         ("staged-auto", T1, PROMPT), ("dyspec-heap-auto", T1, PROMPT), ("gsd-auto", T1, PROMPT),
         ("cascade-auto", T1, PROMPT), ("chain-auto-cpu", T1, PROMPT), ("dyspec-heap-auto-cpu", T1, PROMPT),
         ("suffix", T1, PROMPT), ("suffix-global-auto", TKP, PROMPT), ("staged-mixed", T1, PROMPT),
         ("staged-mixed-auto", TKP, PROMPT), ("cascade-suffix", T1, PROMPT)]


@pytest.mark.parametrize("name,sp,prompt", CASES,
                         ids=[f"{c[0]}-{'t1' if c[1] == T1 else 'topk_topp'}" for c in CASES])
def test_first_two_tokens_exact(small_pair, small_gen, bigram, monkeypatch, name, sp, prompt):
    (p_first, p_joint), spy, strat = run_case(small_pair, small_gen, monkeypatch, name, sp, prompt, N,
                                              50_000 + 7919 * CASES.index((name, sp, prompt)), bigram)
    print(f"[pvalue] tree {name} {sp}: first {p_first:.3g} joint {p_joint:.3g}")
    assert p_first > PASS_P and p_joint > PASS_P, (p_first, p_joint)
    # the q rows are what the strategy promises: sampled children for dyspec, none otherwise
    if name.startswith(("dyspec", "chain")):       # (budget auto: its ar steps are root-only trees)
        assert spy.sampled == spy.trees > 0 if "auto" not in name else spy.sampled > 0
    else:
        assert spy.sampled == 0 and spy.trees > 0
    # the speculation is not vacuous: drafts are accepted and rejected (and GSD merges)
    monkeypatch.setattr(verify_mod, "sampling_choice", sampling_choice)
    # cascade-auto and suffix accept two drafts in ~1% of their steps here (cascade-auto's policy keeps
    # its trees short; the prompt's suffixes rarely continue as the target samples): more runs
    acc, merges, merged_paths, mixed = acceptance(small_gen, strat, sp, prompt,
                                                  runs=100 if name in ("cascade-auto", "suffix") else 25)
    print(f"[accept] tree {name} {sp}: mean accepted {np.mean(acc):.2f}, zero {acc.count(0)}/{len(acc)}, "
          f"merges {merges}, merged paths {merged_paths}")
    assert max(acc) >= (1 if name.endswith("-cpu") else 2) and 0 in acc    # -cpu: the policy keeps trees short
    if name == "gsd":
        assert merges > 0
    if name == "staged-mixed-auto":               # trees with both sources were verified (suffix-only trees:
        assert any({"draft", "suffix"} <= m for m in mixed), mixed     # the `suffix` cases)


# ---------------------------------------------------------------------------------------------
# Broken variants: the same test must reject them
# ---------------------------------------------------------------------------------------------

BROKEN_SP = SamplingParams(temperature=0.7)
BROKEN_PROMPT = [4]          # draft far from the target here: without-replacement siblings matter
N_BROKEN = 500


def dyspec_root_fan() -> DySpec:
    """Four children at the root, all sampled without replacement (depth 1: each is a leaf)."""
    return DySpec("heap", budget=4, batch=4, max_depth=1)


def first_token_p(small_pair, small_gen, strat, n, seed0) -> float:
    p1 = reference_probs(reference_logits(small_pair.target, BROKEN_PROMPT)[-1], BROKEN_SP)
    counts = sample_first(small_gen, BROKEN_PROMPT, strat, BROKEN_SP, n, seed0, ntok=1)
    return chisquare_p(counts, p1)


def test_dyspec_root_fan_exact(small_pair, small_gen):
    """The configuration the broken variant is tested on is itself exact."""
    pval = first_token_p(small_pair, small_gen, dyspec_root_fan(), N_BROKEN, 70_000)
    print(f"[pvalue] dyspec root fan (correct q = residuals): first {pval:.3g}")
    assert pval > PASS_P


def children_with_original_q(orig):
    """DySpec._children, BROKEN: each child drawn records q = its parent's original draft distribution."""
    def children(self, st, tree, slots, *rest):
        out = yield from orig(self, st, tree, slots, *rest)
        for (parent, _), drawn in zip(slots, out):
            if drawn is not None:
                tree.q[drawn[0]] = tree.probs[parent].clone()
        return out
    return children


SEEDED = ["staged", "staged-mixed", "dyspec-heap", "dyspec-threshold", "gsd", "cascade", "cascade-lenient-bigram",
          "staged-auto", "dyspec-heap-auto", "chain-auto-cpu", "suffix", "suffix-global-auto", "staged-mixed-auto",
          "cascade-suffix"]


@pytest.mark.parametrize("name", SEEDED)
def test_a_seeded_answer_is_ars_under_every_strategy(small_gen, bigram, monkeypatch, name):
    """The keyed rule's promise (verify.py): a seeded request's tokens are the ones `ar` draws, one
    per step, whatever tree the strategy grows (budget auto's, a suffix trie fed by earlier answers)
    and whatever shares its batch: 6 seeds alone, then the same 6 submitted together."""
    monkeypatch.setattr(small_gen, "costs", CPU_LIKE if name.endswith("-cpu") else GPU_LIKE)
    strat = make(name, bigram)
    ask = dict(max_new_tokens=10, sampling=TKP if "suffix-global" in name else T1, ignore_eos=True)
    want = [small_gen.generate(PROMPT, strategy="ar", seed=s, **ask).token_ids for s in range(6)]
    alone = [small_gen.generate(PROMPT, strategy=strat, seed=s, **ask) for s in range(6)]
    assert [r.token_ids for r in alone] == want
    assert sum(st.accepted for r in alone for st in r.steps) > 0          # drafts were accepted on the way
    together = [small_gen.submit(PROMPT, strategy=strat, seed=s, **ask) for s in range(6)]
    assert [h.result().token_ids for h in together] == want


def test_q_rows_change_no_answer(small_gen, monkeypatch):
    """dyspec recording q = the parent's original draft distribution for every child (recursive
    rejection's classic bug: biased there) leaves every seeded answer as it was: the rule never reads q."""
    strat = DySpec("heap", budget=6, batch=3, max_depth=3)
    ask = dict(max_new_tokens=8, sampling=BROKEN_SP, ignore_eos=True)
    want = [small_gen.generate(BROKEN_PROMPT, strategy=strat, seed=s, **ask).token_ids for s in range(8)]
    monkeypatch.setattr(dyspec_mod.DySpec, "_children", children_with_original_q(dyspec_mod.DySpec._children))
    assert [small_gen.generate(BROKEN_PROMPT, strategy=strat, seed=s, **ask).token_ids for s in range(8)] == want


def test_no_residual_verifier_is_detected_for_deterministic_children(small_pair, small_gen, monkeypatch):
    """BROKEN verifier (no residual update after a rejected deterministic child) under gsd's top-k fan."""
    monkeypatch.setattr(verify_mod, "sampling_choice", as_choice(verify_sampling_no_residual))
    strat = GSD(top_k=4, sibling_ratio=0.0, confidence=0.0, repeat=-1, budget=4, max_depth=1)
    pval = first_token_p(small_pair, small_gen, strat, 2 * N_BROKEN, 90_000)
    print(f"[pvalue] gsd BROKEN no-residual verifier: first {pval:.3g}")
    assert pval < REJECT_P
