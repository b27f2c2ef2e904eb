"""budget: auto (runtime/budget/) and the step costs it plans with (runtime/costs.py).

The policy on synthetic costs and acceptance: ar (budget 0) when drafts are never accepted; a large
tree when acceptance is high and verification is flat (GPU-like); a small one when each verified
token costs (CPU-like); its choice at least as good as every fixed budget of a grid under the same
synthetic model (node selection, and chains that pay a draft forward per token); a batch's
neighbours shrink a request's tree, and a full batch of one-token rows drafts nothing (nor prefills
its drafts) until it drains; looking ahead, it reaches deep trees that pay where no first
node does (int4-like verify costs); empty probes back off. The cost table interpolates (batched
forwards from measured B-row tables), round-trips through costs.json,
is measured by build / at first use, listed by inspect, and not hashed by the manifest. End to end:
every strategy with budget auto equals ar (greedy), its steps carry the policy's record, and run
--json shows it. Exactness under sampling with budget auto: test_tree_sampling.py (*-auto cases).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import CPU_LIKE, GPU_LIKE
from trtspec.assembly.config import load_config
from trtspec.assembly.build import build_engines
from trtspec.runtime.budget import Acceptance, AutoBudget, BatchView, Round, Values
from trtspec.runtime.costs import COSTS_FILE, CostModel, CostTable, fits, load
from trtspec.runtime.proposal import Proposal
from trtspec.runtime.strategies import STRATEGIES, make_strategy
from trtspec.runtime.tree import TokenTree

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-random.yaml"

CPU, GPU = CPU_LIKE, GPU_LIKE
# the int4 target measured here: a 2-token verify costs 2.4x a 1-token one (M > 1 leaves the int4
# one-token kernel), then flat: no single node pays, a deep tree can
INT4 = CostModel(CostTable([1, 2, 4, 8, 16, 32], [0], [[0.081, 0.192, 0.216, 0.233, 0.286, 0.428]]),
                 CostTable([1, 2, 4, 8, 16, 32], [0], [[0.018, 0.020, 0.025, 0.034, 0.053, 0.090]]))

# measured here with 512 cached tokens (docs/benchmarks.md, issue 13 follow-up), seconds: B rows of T
T5, T4 = [1, 2, 4, 8, 16], [1, 2, 4, 8]
ROWS = CostModel(CostTable(T5, [0], [[.2056, .2265, .2489, .2979, .4031]]),
                 CostTable(T5, [0], [[.0284, .0312, .0424, .0677, .1171]]),
                 rows={"target": {2: CostTable(T5, [0], [[.2451, .2635, .3493, .4408, .7651]]),
                                  4: CostTable(T5, [0], [[.3275, .3874, .5250, .8552, 1.3869]]),
                                  8: CostTable(T4, [0], [[.5030, .5907, .8547, 1.4237]])},
                       "draft": {8: CostTable(T4, [0], [[.1371, .1898, .2875, .4832]])}})
# verification so steep that no tree pays, however good the draft
NEVER = CostModel(CostTable([1, 2, 64], [0], [[0.01, 0.05, 1.0]]), CostTable([1, 64], [0], [[0.01, 0.01]]))


def ask(pol: AutoBudget, tree, forwards, r: Round):
    """`pol.plan(r)` with the step's ledger holding a tree of these node values and these draft forwards."""
    pol.ledger.joined(tree)
    pol.ledger.forwards[:] = forwards
    return pol.plan(r)


class Proposer:
    """A proposer's side of one step, as the strategies keep it: the values of the nodes in its tree and
    its draft forwards' rows, the facts it records in the step's ledger (budget.Ledger) for the
    budget to read with each question (budget.Round) and at the step's end."""

    def __init__(self, pol: AutoBudget):
        self.pol, self.tree, self.forwards = pol, [], []

    def take(self, known, width: int = 0, ahead: int = 0, free: bool = False) -> int:
        return ask(self.pol, self.tree, self.forwards, Round(list(known), width=width, ahead=ahead, free=free)).take

    def feeds(self, known, fed, rows: int, ahead: int) -> bool:
        return ask(self.pol, self.tree, self.forwards, Round(list(known), list(fed), rows, ahead=ahead)).feed

    def observe(self, size: int, accepted: int, emitted: int, seconds: float, node_q=None) -> dict:
        """The step's outcome: a chain of `size` nodes (root included), its first `accepted` drafts accepted."""
        self.pol.ledger.joined(self.tree)
        self.pol.ledger.forwards[:] = self.forwards
        proposal = Proposal(TokenTree.chain(0, [1] * (size - 1)), node_q=node_q)
        return self.pol.observe(proposal, np.arange(accepted + 1), emitted, seconds)


def select(pol: AutoBudget, values: list[float]) -> int:
    """The policy's node selection over candidates sorted best first (as staged's heap offers them)."""
    values = sorted(values, reverse=True)
    return Proposer(pol).take(values)


def rate(costs: CostModel, values: list[float], n: int, draft_s: float = 0.0) -> float:
    top = sorted(values, reverse=True)[:n]
    return (1 + sum(top)) / (draft_s + costs.target(n + 1))


def tree_values(p_top: float, fan: int = 4, depth: int = 12) -> list[float]:
    """Path values of a best-first tree under rank-based acceptance (Sequoia's positional model):
    the k-th child is accepted with p_top * 0.3**(k-1)."""
    ranks = [p_top * 0.3 ** k for k in range(fan)]
    out, frontier = [], [1.0]
    for _ in range(depth):
        frontier = sorted((v * r for v in frontier for r in ranks), reverse=True)[:64]
        out += frontier
    return sorted(out, reverse=True)[:200]


@pytest.mark.parametrize("costs", [CPU, GPU], ids=["cpu", "gpu"])
@pytest.mark.parametrize("p_top", [0.05, 0.3, 0.6, 0.8, 0.95])
def test_node_selection_beats_every_fixed_budget(costs, p_top):
    values = tree_values(p_top)
    pol = AutoBudget(costs, max_nodes=64)
    pol.begin(0)
    n = select(pol, values)
    best_fixed = max(rate(costs, values, k) for k in (0, 1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64))
    assert rate(costs, values, n) >= best_fixed * (1 - 1e-9), (n, rate(costs, values, n), best_fixed)


def test_large_tree_when_acceptance_high_and_verify_flat_small_on_cpu():
    values = tree_values(0.9)
    gpu, cpu = AutoBudget(GPU, max_nodes=64), AutoBudget(CPU, max_nodes=64)
    gpu.begin(0)
    cpu.begin(0)
    assert select(gpu, values) >= 48
    assert 4 <= select(cpu, values) <= 24


def chain_rate(costs: CostModel, p: float, k: int) -> float:
    """A chain of k drafts, each accepted with p given its parent: one draft forward per token."""
    return (1 + sum(p ** i for i in range(1, k + 1))) / (costs.draft(1) * k + costs.target(k + 1)) if k else \
        1 / costs.target(1)


@pytest.mark.parametrize("costs", [CPU, GPU, INT4], ids=["cpu", "gpu", "int4"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8, 0.95])
def test_chain_length_with_draft_forwards_beats_every_fixed_k(costs, p):
    """chain's loop: the first draft forward is paid, then each token is vetted (a Round of one
    candidate) and each further forward too (a Round that asks to feed), both looking ahead along the chain (the next tokens' values guessed
    from the running top-1 estimate). On INT4 costs one draft never pays and 8 do (p = 0.95)."""
    values = Values()
    values.f.update(np.full(400, 0.95), np.random.default_rng(0).random(400) < p)   # calibrated: f(0.95) ~ p
    for _ in range(20):
        values.saw_top1(0.95)
    pol = AutoBudget(costs, max_nodes=32, values=values)
    pol.begin(0)
    me = Proposer(pol)
    me.forwards.append(1)
    value, k = 1.0, 0
    while k < 32:
        v = values.child(value, 0.95)
        if not me.take([v], width=1, ahead=32 - k - 1):
            break
        me.tree.append(v)
        value, k = v, k + 1
        if not me.feeds([], [value], 1, ahead=32 - k):
            break
        me.forwards.append(1)
    f = values.f(0.95)
    best_fixed = max(chain_rate(costs, f, j) for j in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32))
    got = chain_rate(costs, f, k)
    assert got >= best_fixed * 0.98, (k, got, best_fixed)
    if costs is INT4 and p == 0.95:                     # the case a one-node-ahead policy loses
        assert k >= 4 and chain_rate(INT4, f, 1) < chain_rate(INT4, f, 0)


def test_lookahead_feeds_candidates_that_pay_only_as_a_deep_tree():
    """staged's first round on INT4 costs: no prefix of leaves beats ar, the same candidates fed for
    a few rounds do (confident drafts), so the plan takes the width to feed; not without rounds left."""
    scores = Values()
    scores.f.update(np.full(400, 0.95), np.ones(400, dtype=bool))
    for _ in range(20):
        scores.saw_top1(0.97)
    pol = AutoBudget(INT4, max_nodes=32, values=scores)
    pol.begin(0)
    me = Proposer(pol)
    me.forwards.append(1)
    values = [scores.child(1.0, q) for q in (0.97, 0.02, 0.01)]
    assert me.take(values) == 0 and me.take(values, width=1, ahead=0) == 0
    assert me.take(values, width=1, ahead=6) == 1
    assert me.feeds([], [values[0]], 1, ahead=6) and not me.feeds([], [values[0]], 1, ahead=1)


def test_ar_when_drafts_are_never_accepted_then_probes_back_off():
    pol = AutoBudget(CPU, max_nodes=32)
    drafted = []
    for _ in range(60):
        d = pol.begin(100)
        drafted.append(d)
        me = Proposer(pol)
        if d:                                       # a 4-node tree of confident drafts, all rejected
            me.forwards.append(1)
            me.tree += [pol.values.child(1.0, 0.9)] * 4
            me.observe(5, 0, 1, 0.2, lambda: np.array([np.nan, .9, .9, .9, .9]))
        else:
            rec = me.observe(1, 0, 1, 0.17)
            assert rec["budget"] == 0 and rec["predicted_gain"] == 1.0
    assert drafted[0] and not all(drafted[:3])
    assert sum(drafted[20:]) <= 3                     # probes at most every 16 steps
    assert pol.values.f(0.9) < 0.4 < Acceptance()(0.9)   # calibrated: confident drafts are rejected here


def test_a_probe_whose_tree_stays_empty_backs_off_further():
    """A probe pays a draft forward to catch up; when it then adds no node it learned nothing, so
    probes grow rarer than 1 in 16 (64)."""
    pol = AutoBudget(CPU, max_nodes=32)
    drafted = []
    for _ in range(200):
        d = pol.begin(100)
        drafted.append(d)
        me = Proposer(pol)
        if d:
            me.forwards.append(3)                      # nothing added: an empty tree
        me.observe(1, 0, 1, 0.17)
    gaps = np.diff(np.flatnonzero(drafted))
    assert gaps.max() > 16 and gaps[-1] == 65 and sum(drafted) <= 10


def test_a_full_batch_drafts_nothing_until_it_drains():
    """8 one-token rows on the measured CPU costs: one request's tree pads every row, so no tree could
    pay even with a near-perfect draft: every step is ar, with no probes. Alone, or once the batch
    drains to 2 rows, the same request drafts at once (costs gate it, not its history)."""
    view = BatchView()
    view.observe({r: (1, 1.0) for r in range(1, 8)}, [])
    pol = AutoBudget(ROWS, max_nodes=32, batch=view, request=8)
    for _ in range(20):
        pol.values.saw_top1(0.99)
    assert not any(pol.begin(512) for _ in range(300))
    assert AutoBudget(ROWS, max_nodes=32).begin(512)
    view.observe({1: (1, 1.0)}, [])
    assert pol.begin(512)
    assert not AutoBudget(NEVER, max_nodes=32).begin(0)


def test_a_draft_that_must_catch_up_charges_it_over_the_tokens_left():
    """A draft never prefilled (or far behind) first runs a forward over what it lacks. The gate
    shares that out over the tokens the request has left: alone with a whole answer to come it
    drafts; near its end in a 3-row batch (where even an optimistic draft gains ~7%) it does not."""
    view = BatchView()
    view.observe({1: (1, 1.0), 2: (1, 1.0)}, [])
    assert AutoBudget(ROWS, max_nodes=32, batch=view, request=3, left=64).begin(512, behind=2)   # the usual lag
    assert AutoBudget(ROWS, max_nodes=32, left=128).begin(512, behind=200)                        # alone, at the start
    late = AutoBudget(ROWS, max_nodes=32, batch=view, request=3, left=4)
    assert not late.begin(512, behind=200) and late.catch_up_s == pytest.approx(ROWS.draft(200, 512))
    assert AutoBudget(ROWS, max_nodes=32, batch=view, request=3).begin(512, behind=200)          # no end known: free


def test_a_request_alone_between_its_neighbours_requests_does_not_prefill_its_draft():
    """Between one request's end and its client's next submit, the batch runs an iteration a row
    short, where a draft's catch-up could pay (here: 2 rows instead of 3); but a catch-up pays only
    over many steps, and the next arrival fills the row again. The catch-up is also weighed in the
    batch of the recent iterations, so the request stays at ar there; a current draft is used at the
    instant's shape; once the batch has been smaller for RECENT iterations, the draft catches up."""
    from trtspec.runtime.budget.batch_costs import RECENT

    def budget() -> AutoBudget:
        return AutoBudget(ROWS, max_nodes=32, batch=view, request=3, left=64)
    view = BatchView()
    for _ in range(4):
        view.observe({1: (1, 1.0), 2: (1, 1.0), 3: (1, 1.0)}, [])
    assert not budget().begin(512, behind=200)                   # 3 rows: a catch-up does not pay
    view.observe({2: (1, 1.0), 3: (1, 1.0)}, [])                 # request 1 ended; its next not yet here
    assert budget().costs.rows() == 2 and view.recent_rows() == 3
    fresh = BatchView()
    fresh.observe({2: (1, 1.0), 3: (1, 1.0)}, [])
    assert AutoBudget(ROWS, max_nodes=32, batch=fresh, request=3, left=64).begin(512, behind=200)  # 2 rows pay
    assert not budget().begin(512, behind=200)                   # ... but not for an iteration a row short
    assert budget().begin(512, behind=2)                         # a current draft: drafts at once
    for _ in range(RECENT - 1):
        view.observe({2: (1, 1.0), 3: (1, 1.0)}, [])
    assert view.recent_rows() == 2 and budget().begin(512, behind=200)   # 2 rows for RECENT iterations


def test_free_trees_that_gain_raise_the_bar_for_prefilling_a_draft():
    """Where a request's steps without a draft forward (suffix trees) have been gaining well over ar,
    the gate does not prefill a draft that even optimistically would gain less; ar-like free steps
    leave the bar at ar, and a draft that is current is left to the step's own choice. A suffix tree
    is weighed against the tree the draft would grow after paying its catch-up: the same candidates
    that do not pay for a prefill pay once the draft is current."""
    def budget(free_steps: list[tuple[int, int]]) -> AutoBudget:
        pol = AutoBudget(ROWS, max_nodes=32, left=64)
        for tree, emitted in free_steps:                   # free steps: no draft forward ran
            pol.begin(512)
            Proposer(pol).observe(tree, emitted - 1, emitted, 0.2)
        return pol
    assert budget([(1, 1)] * 10).begin(512, behind=200)                 # ar-like: the draft may pay
    assert not budget([(8, 8)] * 10).begin(512, behind=200)             # suffix trees gaining ~4x: it cannot
    assert budget([(8, 8)] * 10).begin(512, behind=2)                   # a current draft: weighed per step
    cheap = budget([])
    cheap.begin(512, behind=2)
    costly = budget([])
    costly.begin(512, behind=200)
    sfx, frontier = [0.5], [0.5, 0.5]                   # one suffix candidate; the draft's reach (top-1 0.5)
    assert Proposer(cheap).feeds(sfx, frontier, 2, ahead=8)
    assert not Proposer(costly).feeds(sfx, frontier, 2, ahead=8)


def test_beside_a_head_the_draft_is_measured_once_then_judged_by_its_measure():
    """A drafter that offers a tree every step (a head) would keep a draft judged by its prior top-1
    (0.5) from ever being fed, so from ever being measured (docs/bench/head-role/why_no_draft.txt).
    Asked with `measure`, an unmeasured draft is weighed as the gate's optimistic one; once measured
    (`Values.measure_top1` replaces the prior), by what it showed; without `measure`, as before."""
    head, frontier = [0.6, 0.3], [0.4, 0.3]            # the head's tree; where a draft would add to it
    feeds = {}
    for measured in (None, 0.05, 0.97):
        pol = AutoBudget(ROWS, max_nodes=32, left=128)
        pol.begin(512)
        if measured is not None:
            pol.values.measure_top1(measured)
        for measure in (False, True):
            feeds[measured, measure] = pol.plan(Round(known=head, feed=frontier, rows=2, ahead=8,
                                                      measure=measure)).feed
    assert not feeds[None, False] and feeds[None, True]                  # the prior alone: never fed
    assert not feeds[0.05, True] and feeds[0.97, True]                   # measured: judged by it
    values = Values()
    values.saw_top1(0.97)
    values.measure_top1(0.05)                          # a draft seen already: its running estimate stays
    assert values.top1 == pytest.approx(0.7 * 0.5 + 0.3 * values.f(0.97)) and values.top1_seen == 1


def test_a_free_tree_must_beat_the_batch_all_at_ar():
    """A suffix tree costs no draft forward, but it pads every row of a batched verify: it is taken only
    if the batch's rate with it beats everyone at ar, not merely the batch as the neighbours padded
    it last step (they would all keep padding one another)."""
    view = BatchView()
    view.observe({r: (4, 1.2) for r in range(1, 8)}, [])            # 7 neighbours verified 4-token trees
    pol = AutoBudget(ROWS, max_nodes=32, batch=view, request=8)
    pol.begin(512)
    values = [0.3, 0.09, 0.03]
    assert Proposer(pol).take(values) == 3                             # against their padding: looks free
    assert Proposer(pol).take(values, free=True) == 0                  # against all at ar: a loss
    alone = AutoBudget(ROWS, max_nodes=32)
    alone.begin(512)
    assert Proposer(alone).take([0.9, 0.8, 0.7], free=True) == 3


def test_a_plan_depends_on_its_round_and_the_ledger_alone():
    """The budget keeps no tally of its own within a step: the step's ledger holds the tree's values and
    the draft forwards so far, so the same question at the same ledger gets the same answer whatever
    was asked before it (the proposer's facts are the budget's only state besides what begin() and
    observe() set)."""
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(60):
        tree = sorted(rng.random(rng.integers(0, 6)).tolist(), reverse=True)
        forwards = rng.integers(1, 8, rng.integers(0, 4)).tolist()
        known = sorted((rng.random(rng.integers(1, 8)) * 0.9).tolist(), reverse=True)
        rows = int(rng.integers(0, 2)) * int(rng.integers(1, 6))
        rounds.append((tree, forwards, Round(known, known[:2] if rows else (), rows, width=int(rng.integers(0, 4)),
                                             ahead=int(rng.integers(0, 4)), free=bool(rng.random() < 0.2))))
    for costs in (CPU, GPU, INT4):
        asked = AutoBudget(costs, max_nodes=16)
        asked.begin(256)
        answers = [ask(asked, *r) for r in rounds]                   # one budget, every question in turn
        for r, got in zip(rounds, answers):
            fresh = AutoBudget(costs, max_nodes=16)
            fresh.begin(256)
            assert ask(fresh, *r) == got
        assert {a.take for a in answers} != {0} and {a.feed for a in answers} == {True, False}


def test_one_round_answers_as_its_questions_asked_one_by_one():
    """A proposer asks once per round (Round.then, Round.bar_ahead): the answer is what the questions
    asked apart would answer. The take is the take alone; the feed is the feed question asked after
    the take (what was taken fed, `then` more rows, the next `width` known as the alternative); each
    bar splits the values a node joining later is taken at, alone, from those it is not (`_take` with
    width 1 and that look-ahead, at the tree and the forwards the take and the feed leave)."""
    rng = np.random.default_rng(1)
    view = BatchView()
    view.observe({r: (3, 1.6) for r in range(1, 4)}, [{r: 2 for r in range(1, 4)}, {r: 4 for r in range(1, 4)}])
    checked = {"fed": 0, "bars": 0, "finite": 0}
    for costs, batch in ((CPU, None), (GPU, None), (INT4, None), (ROWS, view)):
        for _ in range(40):
            pol = AutoBudget(costs, max_nodes=int(rng.integers(2, 12)), batch=batch, request=9)
            pol.begin(256)
            pol.values.top1 = float(rng.uniform(0.2, 1.0))
            tree = sorted(rng.random(rng.integers(0, 5)).tolist(), reverse=True)
            forwards = rng.integers(1, 6, rng.integers(1, 3)).tolist()
            known = sorted((rng.random(rng.integers(0, 6)) * 0.95).tolist(), reverse=True)
            width, ahead, then, bar_ahead = (int(x) for x in rng.integers([1, 0, 0, 0], [4, 5, 6, 8]))
            got = ask(pol, tree, forwards, Round(known, width=width, ahead=ahead, then=then, bar_ahead=bar_ahead))
            assert got.take == ask(pol, tree, forwards, Round(known, width=width, ahead=ahead)).take
            after = [*tree, *known[:got.take]]
            want_feed = got.take > 0 and ask(pol, after, forwards, Round(known[got.take:got.take + width],
                                                                         known[:got.take], got.take + then,
                                                                         ahead=ahead)).feed
            assert got.feed == want_feed
            checked["fed"] += got.feed
            forwards_after = [*forwards, got.take + then] if got.feed else forwards
            assert len(got.bars) == bar_ahead + 1
            for a, bar in enumerate(got.bars):
                checked["finite"] += bar < float("inf")
                for v in rng.uniform(0, 1, 12).tolist() + ([bar * 0.999, bar * 1.001] if bar < 1 else []):
                    alone = ask(pol, after, forwards_after, Round([v], width=1, ahead=a)).take > 0
                    assert got.joins(v, a) == alone, (a, v, bar)
                    checked["bars"] += 1
    assert checked["fed"] > 10 and checked["finite"] > 100 and checked["bars"] > 1000


def test_acceptance_prior_and_calibration():
    f = Acceptance()
    assert f(0.0) < 0.02 and 0.45 < f(0.5) < 0.6 and f(1.0) > 0.95     # prior: the draft is calibrated
    f.update(np.full(200, 0.85), np.arange(200) < 60)                   # 30% accepted at q = 0.85
    assert abs(f(0.85) - 0.3) < 0.05 and f(0.55) > 0.5                 # other bins keep their prior


def test_expected_value_of_a_sampled_child_is_its_per_token_mean():
    """Acceptance.expected (computed where the draft's probabilities are) = sum_y draw(y) f(q(y)),
    with f the calibrated per-bin rate; q values on every bin edge included."""
    f = Acceptance()
    f.update(np.full(50, 0.85), np.arange(50) < 10)
    rng = np.random.default_rng(0)
    q = np.concatenate([[0.0, 0.02, 0.05, 0.5, 0.95, 1.0], rng.random(58)])
    q /= q.sum() * 0.5                                   # some q(y) > 1 before clipping to the last bin
    draw = rng.random(64)
    draw, q = torch.from_numpy(draw / draw.sum()).float(), torch.from_numpy(q).float()
    want = sum(float(d) * f(float(x)) for d, x in zip(draw, q))
    assert float(f.expected(draw, q)) == pytest.approx(want, rel=1e-5)


def test_batch_neighbours_shrink_the_tree_on_cpu():
    values = tree_values(0.8)
    alone = AutoBudget(CPU, max_nodes=64)
    alone.begin(0)
    view = BatchView()
    view.observe({r: (4, 3.0) for r in range(1, 8)},   # 7 neighbours: 4-token trees, ~3 tokens expected
                 [{r: 2 for r in range(1, 8)}, {r: 5 for r in range(1, 8)}])
    crowded = AutoBudget(CPU, max_nodes=64, batch=view)
    crowded.begin(0)
    assert select(crowded, values) < select(alone, values)


def test_batch_forwards_are_costed_padded_and_the_draft_joins_its_round():
    """A forward over B rows costs what the Batcher runs: B rows padded to the longest. A draft
    forward joins the neighbours' forward of the same round (its marginal cost), or runs alone."""
    view = BatchView()
    view.observe({r: (2, 1.5) for r in range(1, 9)}, [{r: 2 for r in range(1, 9)}, {r: 10 for r in range(1, 9)}])
    pol = AutoBudget(CPU, max_nodes=64, batch=view, request=8)          # request 8's own entries are not neighbours
    pol.begin(0)
    assert pol.costs.verify_s(0) == pytest.approx(CPU.target(8 * 2))          # my root row pads to 2 like theirs
    assert pol.costs.verify_s(7) == pytest.approx(CPU.target(8 * 8))          # a tree of 8 pads every row to 8
    assert pol.draft_s == pytest.approx(CPU.draft(7 * 2) + CPU.draft(7 * 10))   # their draft time, before mine
    # round 0: joins theirs; round 1: within their 10, padded; round 2: nobody else: alone
    ask(pol, [], [2, 4, 3], Round())
    assert pol.draft_s == pytest.approx(CPU.draft(8 * 2) + CPU.draft(8 * 10) + CPU.draft(3))
    assert pol.costs.all_ar_rate() == pytest.approx(8 / CPU.target(8))        # the batch if everyone took ar
    alone = AutoBudget(CPU, max_nodes=64)
    alone.begin(0)
    ask(alone, [], [2, 3], Round())                                    # the forward that opened the tree, then 3 rows
    assert alone.draft_s == pytest.approx(CPU.draft(2) + CPU.draft(3)) and alone.costs.verify_s(4) == pytest.approx(CPU.target(5))
    view.forget(3)                                                      # a neighbour ended: out of the view
    assert pol.costs.verify_s(0) == pytest.approx(CPU.target(7 * 2)) and 3 not in view.draft[0]


def test_in_a_batch_drafting_must_beat_everyone_taking_ar():
    """Each neighbour drafting makes one more tree look cheap (the batch waits anyway), so the gate
    compares the batch with trees against the batch with no drafting at all."""
    view = BatchView()
    view.observe({r: (4, 2.0) for r in range(1, 4)}, [{r: 2 for r in range(1, 4)}, {r: 5 for r in range(1, 4)}])
    pol = AutoBudget(CPU, max_nodes=64, batch=view, request=8)
    assert pol.begin(0)                                   # no history yet, and a good tree could pay: draft
    me = Proposer(pol)
    me.forwards.append(2)
    me.tree += [pol.values.child(1.0, 0.6)] * 5
    rec = me.observe(6, 1, 2, 1.0, lambda: np.full(6, 0.6))
    # with the neighbours' 2 tokens each, the batch makes 3 * 2 + 2 = 8 tokens per iteration of
    # 2 draft forwards + a target forward over 4 rows of 4-6 tokens: fewer per second than 4 ar rows
    assert rec["modelled_gain"] < 1 and not pol.begin(0)


def test_batched_forwards_use_the_measured_row_tables():
    """B rows of T tokens: the B-row tables where measured (linear in B between them, B = 1 the
    single-row table), else one row of B x T tokens; stored and read back with costs.json."""
    single = CostTable([1, 8], [0], [[1.0, 2.0]])
    rows = {2: CostTable([1, 4], [0], [[1.5, 2.5]]), 8: CostTable([1], [0], [[4.0]])}
    m = CostModel(single, single, rows={"target": rows})
    assert m.forward("target", [1]) == 1.0 and m.forward("target", []) == 0.0
    assert m.forward("target", [1, 1]) == 1.5 and m.forward("target", [4, 1]) == pytest.approx(2.5)
    assert m.forward("target", [1] * 5) == pytest.approx(1.5 + (4.0 - 1.5) * 3 / 6)
    assert m.forward("draft", [1] * 8) == pytest.approx(single(8))       # no draft rows measured
    back = CostModel.from_dict(json.loads(json.dumps(m.to_dict())))
    assert back.forward("target", [1] * 5) == m.forward("target", [1] * 5) and back.rows["target"][8].tokens == [1]
    pol = AutoBudget(m, max_nodes=8, batch=BatchView({1: (1, 1.0)}, []), request=2)
    pol.begin(0)
    assert pol.costs.all_ar_s() == 1.5 and pol.costs.verify_s(3) == pytest.approx(rows[2](4))


def test_cost_table_interpolates_and_extrapolates():
    t = CostTable([1, 4, 16], [0, 1000], [[1.0, 2.0, 5.0], [2.0, 3.0, 6.0]])
    assert t(1, 0) == 1.0 and t(2.5, 0) == pytest.approx(1.5) and t(16, 500) == pytest.approx(5.5)
    assert t(28, 0) == pytest.approx(8.0) and t(1, 2000) == pytest.approx(3.0)     # linear past the grid
    assert CostModel.from_dict(json.loads(json.dumps(CPU.to_dict()))).target(10) == pytest.approx(CPU.target(10))


def test_cost_table_never_falls_past_its_grid():
    """A noisy table (the draft measured 64 tokens cheaper after 512 cached than after 64; the target
    2 tokens) must not price a long prompt's prefill at 0 s, nor a small tree below a one-token step:
    past the grid more tokens or more cache never cost less, and past the cached grid every N grows
    as the one-token step does."""
    t = CostTable([1, 2, 32, 64], [64, 512], [[0.026, 0.031, 0.237, 0.466], [0.029, 0.028, 0.205, 0.381]])
    grow = (0.029 + 0.003 * 3920 / 448) / 0.029
    assert t(4432, 4432) == pytest.approx(t(4432, 512) * grow) and t(4432, 512) > 20
    assert t(1, 4432) == pytest.approx(0.029 * grow) and t(64, 4432) == pytest.approx(0.381 * grow)
    assert t(2, 4432) >= 0.9 * t(1, 4432)         # continued column by column: 0.5x
    falling = CostTable([1, 2], [0], [[2.0, 1.0]])                 # more tokens measured cheaper
    assert falling(10) == 1.0 and falling(0) == 2.0
    flat = CostTable([1, 4], [0, 100], [[1.0, 2.0], [0.9, 1.8]])    # one-token step measured cheaper with cache
    assert flat(4, 10_000) == pytest.approx(1.8) and flat(1, 10_000) == pytest.approx(0.9)
    assert CostModel(t, t).forward("draft", [4432], 4432) > 20


def test_auto_is_the_default_of_every_tree_strategy_and_fixed_stays():
    for name in ("chain", "staged", "dyspec", "gsd", "cascade", "suffix"):
        assert make_strategy(name).auto_nodes() is not None, name
    assert make_strategy("staged", budget=12).auto_nodes() is None
    assert make_strategy("cascade", k_draft=6).auto_nodes() is None
    assert make_strategy("chain", k=4).max_tree_size() == 5
    assert all(make_strategy(n).auto_nodes() is None for n in ("ar", "ngram"))
    assert set(STRATEGIES) == {"ar", "ngram", "chain", "staged", "dyspec", "gsd", "cascade", "suffix"}


@pytest.mark.parametrize("strategy", ["chain", "staged", "dyspec", "dyspec:variant=threshold", "gsd", "cascade"])
def test_auto_equals_ar_and_records_the_policy(small_pair, strategy):
    """On the 16-token pair (peaked draft distributions) with GPU-like costs, trees do get drafted."""
    gen = small_pair.generator(capacity=256, costs=GPU)
    prompt = [1, 3, 5, 1, 3, 5, 1]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=30).token_ids
    res = gen.generate(prompt, strategy=strategy, max_new_tokens=30)
    assert res.token_ids == ref
    recs = [s.extra for s in res.steps]
    assert all({"budget", "predicted_gain", "measured_gain", "expected_accepted"} <= r.keys() for r in recs)
    assert max(r["budget"] for r in recs) >= 2
    assert all(s.tree_size == r["budget"] + 1 for s, r in zip(res.steps, recs))     # the policy counts every node
    gen.close()


@pytest.mark.parametrize("strategy", ["chain", "staged:suffix=false"])
def test_the_draft_is_prefilled_lazily(small_pair, strategy):
    """budget auto prefills a request's draft at its first drafted step: never, where no tree pays;
    catching up a 300-token prompt (chunks of at most 256) where trees do; ar's tokens either way."""
    prompt = [1, 3, 5, 7] * 75
    never = small_pair.generator(capacity=512, costs=NEVER)
    ref = never.generate(prompt, strategy="ar", max_new_tokens=20).token_ids
    res = never.generate(prompt, strategy=strategy, max_new_tokens=20)
    assert res.token_ids == ref and never.batchers["draft"].forwards == 0
    assert res.stats["draft_forwards"] == 0 and all(s.tree_size == 1 for s in res.steps)
    never.close()
    gen = small_pair.generator(capacity=512, costs=GPU)
    res = gen.generate(prompt, strategy=strategy, max_new_tokens=20)
    assert res.token_ids == ref and res.steps[0].tree_size > 1
    assert gen.batchers["draft"].forwards >= 2 + sum(s.tree_size > 1 for s in res.steps)   # 2 prefill chunks first
    gen.close()


def test_requests_admitted_together_plan_their_first_step_as_a_batch(small_pair):
    """Four requests submitted at once on the measured CPU costs: each plans its first step with the
    other three in view (their prefills ran with it), so none drafts and no draft is prefilled;
    one alone drafts from its first step."""
    prompts = [[1, 3, 5, 7] * 10, [2, 4, 6] * 12, [5, 1] * 20, [7, 7, 3] * 11]
    gen = small_pair.generator(capacity=192, costs=ROWS, slots=4)
    refs = [gen.generate(p, strategy="ar", max_new_tokens=12).token_ids for p in prompts]
    with gen.scheduler._cv:                       # the scheduler thread waits: all four arrive at once
        handles = [gen.submit(p, strategy="staged:suffix=false", max_new_tokens=12) for p in prompts]
    results = [h.result() for h in handles]
    assert [r.token_ids for r in results] == refs and gen.batchers["draft"].forwards == 0
    assert all(s.tree_size == 1 and not s.extra["drafted"] for r in results for s in r.steps)
    # With suffix drafts (suffix: true) the same crowded first step still speculates, for free.
    with gen.scheduler._cv:
        handles = [gen.submit(p, strategy="staged:suffix=true", max_new_tokens=12) for p in prompts]
    results = [h.result() for h in handles]
    assert [r.token_ids for r in results] == refs
    first = [r.steps[0] for r in results]
    assert all(not s.extra["drafted"] and s.draft_forwards == 0 for s in first)
    assert all(s.tree_size > 1 and set(s.extra["sources"]) == {"suffix"} for s in first)
    alone = gen.generate(prompts[0], strategy="staged:suffix=false", max_new_tokens=12)
    assert alone.token_ids == refs[0] and alone.steps[0].extra["drafted"] and gen.batchers["draft"].forwards > 0
    gen.close()


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("eng") / "tiny"
    build_engines(load_config(TINY), out, backend="torch", log=lambda *a, **k: None)
    return out


def test_costs_stored_listed_and_not_hashed(tiny_folder):
    """build measured costs.json; load uses it (no re-measuring), inspect lists it, verify ignores it,
    --measure-costs writes it again."""
    from click.testing import CliRunner

    from trtspec.cli import main
    from trtspec.assembly.load import load_generator
    from trtspec.engines.manifest import verify
    costs = load(tiny_folder)
    assert costs is not None and costs.draft is not None and costs.meta["backend"] == "torch"
    assert sorted(costs.rows["target"]) == sorted(costs.rows["draft"]) == [2, 4, 8]       # batched forwards
    assert all(b * max(t.tokens) <= 64 and min(min(r) for r in t.seconds) > 0 for b, t in costs.rows["target"].items())
    gen = load_generator(tiny_folder)
    key = gen.stored_costs.key
    assert fits(costs, key) and key["backend"] == "torch" and key["draft"]
    assert gen.costs is None                      # tiny-random's strategies (chain k 4, ngram) have no auto
    assert gen.step_costs().meta["measured"] == costs.meta["measured"]         # read, not measured again
    assert not fits(costs, {**key, "threads": 7})
    gen.close()
    verify(tiny_folder)
    out = CliRunner().invoke(main, ["inspect", "--engines", str(tiny_folder)])
    assert out.exit_code == 0 and "step costs (" in out.output and "target C=" in out.output
    before = costs.meta["measured"]
    (tiny_folder / COSTS_FILE).unlink()
    out = CliRunner().invoke(main, ["inspect", "--engines", str(tiny_folder), "--measure-costs"])
    assert out.exit_code == 0, out.output
    assert load(tiny_folder) is not None and load(tiny_folder).meta["measured"] >= before
    verify(tiny_folder)


def test_run_json_has_per_step_policy_records(tiny_folder):
    from click.testing import CliRunner

    from trtspec.cli import main
    out = CliRunner().invoke(main, ["run", "--engines", str(tiny_folder), "--strategy", "staged", "--prompt", "def f(x):",
                                    "--max-new-tokens", "12", "--json"])
    assert out.exit_code == 0, out.output
    steps = json.loads(out.output.strip().splitlines()[-1])["steps"]
    assert steps and all("budget" in s and "predicted_gain" in s and "measured_gain" in s for s in steps)


def test_bench_variants_policy_records_and_projection(tiny_folder, tmp_path):
    """bench: a strategy with overrides is its own runner; auto runners carry per-step policy columns,
    results.md a budget: auto table and policy.png; --plan-costs plans with another table (projection)."""
    from click.testing import CliRunner

    from trtspec.cli import main
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                            for i, p in enumerate(["def fib(n):\n    return", "a = 1\nb = 2\na = 1\nb ="])))
    gpu = tmp_path / "gpu.json"
    gpu.write_text(json.dumps(GPU.to_dict()))
    out = tmp_path / "res"
    r = CliRunner().invoke(main, ["bench", "--engines", str(tiny_folder), "--dataset", str(data), "--peers", "none",
                                  "--strategies", "staged,staged:budget=4", "--max-new-tokens", "10", "--threads", "1",
                                  "--plan-costs", str(gpu), "--output", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["runners"] == ["ar", "staged", "staged:budget=4"]
    assert res["settings"]["strategy_options"]["staged:budget=4"]["budget"] == 4
    for p in res["prompts"]:
        assert p["runs"]["staged:budget=4"]["matches_ar"] and p["runs"]["staged"]["matches_ar"]
        assert "policy" not in p["runs"]["staged:budget=4"]
        pol = p["runs"]["staged"]["policy"]
        n = p["runs"]["staged"]["target_steps"]
        assert all(len(pol[k]) == n for k in ("budget", "accepted", "predicted_gain", "modelled_s", "ar_s"))
        assert all(s == pytest.approx(0.010, rel=0.2) for s in pol["ar_s"])      # GPU's table, not this CPU's
    md = (out / "results.md").read_text()
    assert "## budget: auto, what the policy chose" in md and "projection" in md and "policy.png" in md
    assert (out / "policy.png").stat().st_size > 1000
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = CliRunner().invoke(main, ["bench", "--engines", str(tiny_folder), "--dataset", str(data), "--peers", "none",
                                  "--plan-costs", str(bad)])
    assert r.exit_code != 0 and "--plan-costs" in r.output and "Traceback" not in r.output
