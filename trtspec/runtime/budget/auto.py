"""budget: auto — size every step's tree from measured step costs and live acceptance estimates.

A step emits 1 + A tokens, A = the accepted drafts, and costs D (draft forwards) + V(n) (one target
forward over the root and n nodes; costs.py measures both, batch_costs.py reads them at the batch's
shapes). The budget grows a tree best-first and adds a node only while it raises the step's
expected rate

    r(n) = (1 + E[A]) / (D + V(n)),      E[A] = sum over the tree's nodes of P(node accepted)

i.e. the known candidates are added as the prefix (best value first) that maximises r, and a node
seen alone is added while its value v (the probability that it is reached and accepted) exceeds r
times the marginal verify cost V(n+1) - V(n). Both look ahead: a node (or a set of candidates to
feed) that does not pay as a leaf is still taken when the tree it would grow pays, its children
guessed as value x the draft's recent calibrated top-1 acceptance, over as many more draft forwards
as the strategy allows (`_ahead`; on a CPU a 2-token verify costs ~2x a 1-token one, so a deep
tree that pays is never reached one unprofitable node at a time). One more draft forward is paid
only if the best tree reachable with it beats the candidates already known. Whether a step drafts
at all is the ar gate's call (gate.py).

P(node accepted) = product over its path of f(q) (acceptance.py). The budget decides which tree is
verified, never how: verification is the same exact rule, so the output is lossless whatever tree
it chooses from the past. One rule keeps sampling exact: a child that is SAMPLED (chain, dyspec
under temperature) joins the tree or not before it is drawn (`Values.drawn`), never by which token it
turned out to be. Tests: every strategy with budget auto equals ar (greedy) and passes chi-square.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..costs import CostModel
from .batch_costs import BatchCosts, BatchView
from .gate import ArGate
from .plan import Ledger, Plan, Round
from .records import step_record
from .values import Values

if TYPE_CHECKING:
    from ..proposal import Proposal

HOPE_TOP1 = 0.9        # a step drafts only if a chain this good (each node accepted w.p. 0.9 given its
HOPE_FORWARDS = 8      # parent, or the request's own top-1 rate if higher, up to 8 draft forwards) could pay
FREE_EMA = 0.15        # weight of the newest step in the running gain of steps with no draft forward


class AutoBudget:
    """One request's budget (lives in its DecodeState): the shared step begin()s a step, its proposer
    asks plan() each round (what to take, whether to feed), the shared step observe()s the outcome.
    It sizes; `values` (the request's Values, which observe() calibrates) score."""
    adaptive = True

    def __init__(self, costs: CostModel, max_nodes: int, batch: BatchView | None = None, request: int = 0,
                 left: int | None = None, values: Values | None = None, heads=()):
        self.max_nodes = max_nodes
        self.left = left                    # tokens this request may still emit (None: unbounded)
        self.catch_up_s = 0.0               # this step: the draft's catch-up forward, if it must make one
        self.free_gain = 1.0                # running gain over ar of this request's steps with no draft forward
        self.costs = BatchCosts(costs, batch or BatchView(), request, heads)   # heads: the kinds its drafters ask
        self.gate = ArGate()
        self.values = values or Values()
        self.last_expected = 1.0            # expected emitted tokens of this request's last step
        self.ledger = Ledger()              # this step's facts, as its proposer records them (plan.py)
        # The step so far, as the ledger held it when last asked (`_sync`): its draft forwards (tokens each, as
        # charged), their seconds on top of the neighbours' (`base_s`), its nodes and their values' sum.
        self.rounds: list[int] = []
        self.base_s, self.draft_s, self.expected, self.nodes = 0.0, 0.0, 0.0, 0

    def expected_emitted(self) -> float:
        """This request's expected emitted tokens in its last step (the scheduler's batch view)."""
        return self.last_expected

    # -- one step ---------------------------------------------------------------------------------
    def begin(self, cached: int, behind: int = 0) -> bool:
        """Start a step after `cached` committed tokens, the draft `behind` tokens short of them (it
        catches up when a tree opens); False = make it a plain ar step."""
        self.costs.cached = cached
        self.base_s = self.costs.neighbours_draft_s()
        self.ledger = Ledger()
        self._sync((), ())
        # more than the usual lag of a drafted step (its last emitted tokens): a forward of its own
        self.catch_up_s = self.costs.padded("draft", [behind]) if behind > 2 and self.costs.model.draft else 0.0
        return self.gate.decide(self.could_pay, self.costs.rows())

    def could_pay(self) -> bool:
        """Could any tree pay in this step at this batch's costs? An optimistic draft's chain (every
        node accepted w.p. HOPE_TOP1 given its parent, or the request's recent top-1 rate if higher)
        over up to HOPE_FORWARDS draft forwards must beat both the batch with everyone at ar and
        this request's own ar step. Alone on a CPU it always can (a measured one-token step of
        200 ms, a 2-token one of 226 ms); in a batch of many one-token rows it cannot (8 rows: one
        request's tree pads every row, 503 -> 590 ms for 2 tokens), so such a batch runs ar and
        probes nothing, and a lazily prefilled draft (request.py) is not even prefilled. Costs
        only: no acceptance history gates it, so a drained batch drafts again at once. A draft that
        must first catch up (never prefilled, or behind after ar steps) charges that forward, shared
        out over the tokens the request has left (each emitted token carries catch_up / left): a
        request near its end in a briefly drained batch does not prefill its draft for a step or
        two (measured: four requests at once, each paid ~0.6 s of draft prefill for 2 tokens). Where
        the draft must catch up and the strategy has free trees (suffix drafts), the bar is also what
        this request's steps without a draft forward have been gaining (`free_gain`): a request whose
        suffix trees gain 1.4x ar does not prefill a draft that could at best gain 1.05x (measured on
        repeated JSON requests: 2-3 draft forwards per request, ~1.3 s of draft prefill, for 1-3
        draft tokens). A draft that is current is weighed against the suffix tree step by step
        (a Round that asks to feed), with no such bar. A catch-up must also pay in the batch as the
        recent iterations had it (`BatchCosts.recent`): a request alone for an iteration or two
        between its neighbours' requests does not prefill a draft the next arrival makes useless."""
        if not self._could_pay(self.costs):
            return False
        recent = self.costs.recent() if self.catch_up_s else None
        return recent is None or self._could_pay(recent)

    def _could_pay(self, costs: BatchCosts) -> bool:
        rates = self._ahead([], [1.0], 1, HOPE_FORWARDS, top1=self._hoped_top1(), per_token=self._catch_up(),
                            costs=costs)
        bar = costs.all_ar_rate() * (max(self.free_gain, 1.0) if self.catch_up_s else 1.0)
        return max(rates[1:]) > max(rates[0], bar)

    def _hoped_top1(self) -> float:
        """The optimistic draft's top-1 acceptance: HOPE_TOP1, or the request's own if higher."""
        return max(self.values.top1, HOPE_TOP1)

    def _catch_up(self) -> float:
        """Seconds charged per emitted token of a drafted step for the draft's catch-up forward, if it
        must make one: that forward shared out over the tokens the request has left."""
        return self.catch_up_s / max(self.left, 1) if self.catch_up_s and self.left is not None else 0.0

    def plan(self, r: Round) -> Plan:
        """The answer to one round's question (plan.Round): how many to take, whether to feed (what was
        taken, with `then`), and the bars of the round's later nodes (with `bar_ahead`); the tree and
        the draft forwards so far: the step's ledger."""
        tree, forwards = self.ledger.tree, list(self.ledger.forwards)
        self._sync(tree, forwards)
        known, take, feed, rows = list(r.known), 0, False, r.rows
        if r.rows:
            unseen = r.measure and not self.values.top1_seen       # the draft never measured: hope, as the gate
            feed = self._worth_feeding(known, list(r.feed), r.rows, r.ahead, self._hoped_top1() if unseen else None)
        elif r.free:
            take = self._take_free(known)
        else:
            take = self._take(known, r.width, r.ahead)
            if take and r.then is not None:
                rows = take + r.then
                self._sync([*tree, *known[:take]], forwards)
                feed = self._worth_feeding(known[take:take + r.width], known[:take], rows, r.ahead)
        if r.bar_ahead is None:
            return Plan(take, feed)
        self._sync([*tree, *known[:take]], [*forwards, rows] if feed else forwards)
        return Plan(take, feed, self._bars(r.bar_ahead))

    def _bars(self, ahead: int) -> tuple[float, ...]:
        """bars[a]: the least value v of one more node that `_take([v], width=1, a)` would add, for a = 0 ..
        `ahead`: in closed form, as the rate is (E + v S_j) / (D_k + V(n + j)) for the node and a chain
        of j - 1 guessed children (values v top1^i, S_j their sum / v) grown in k more draft forwards
        (j <= k + 1), and it must beat the tree's rate now, E / (D_0 + V(n)). tests/integration/test_budget.py
        checks it against `_take` itself."""
        r0 = self.costs.rate(self.expected, self.nodes, self.draft_s)
        now = self.draft_s + self.costs.verify_s(self.nodes)
        room = max(self.max_nodes - self.nodes, 0)
        bars, bar, draft_s = [], float("inf"), self.draft_s
        for k in range(ahead + 1):
            if k:
                draft_s += self.costs.draft_marginal(1, len(self.rounds) + k - 1)
            s = 0.0
            for j in range(1, min(k + 1, room) + 1):
                s += self.values.top1 ** (j - 1)
                bar = min(bar, r0 * (draft_s + self.costs.verify_s(self.nodes + j) - now) / s)
            bars.append(bar)
        return tuple(bars)

    def _sync(self, tree, forwards) -> None:
        """The step so far from the proposer's facts: the tree's node values (in the order they joined)
        and its draft forwards' rows. The forward that opened the tree fed the tokens the draft had not
        seen; after ar steps those are many, once: charged as the usual lag of 2, so that catching up
        does not make the probe step look worse than drafting is."""
        self.expected, self.nodes = 0.0, len(tree)
        for v in tree:
            self.expected += v
        self.draft_s, self.rounds = self.base_s, []
        for i, rows in enumerate(forwards):
            tokens = min(rows, 2) if i == 0 else rows
            self.draft_s += self.costs.draft_marginal(tokens, i)
            self.rounds.append(tokens)

    def _take(self, values: list[float], width: int = 0, ahead: int = 0) -> int:
        """How many of the known candidates (values, best first) to add now: the prefix that maximises
        the step's rate. Not a marginal stop at the first loss: measured CPU costs have steps (GEMM
        blocking: 4 -> 8 tokens can cost less than 1 -> 2), so a longer prefix may pay where a shorter
        one does not. With `ahead` > 0, the best `width` of them are taken (to be fed) when the tree
        they would grow in up to `ahead` more draft forwards beats every prefix of leaves."""
        k, r = self._best_prefix(values, self.draft_s)
        front = values[:width] if ahead > 0 else []
        if len(front) > k and max(self._ahead(values, front, len(front), ahead)) > r:
            return len(front)
        return k

    def _take_free(self, values: list[float]) -> int:
        """How many of the candidates of a tree that costs no draft forward (a suffix tree) to verify:
        the best prefix, and none unless it beats the batch with everyone at ar. Each request
        judging its tree against its neighbours' last trees alone would find their padding already
        paid and add its own, so that every row stays padded (measured: 8 requests with free
        suffix trees, 0.62x ar's throughput)."""
        k, r = self._best_prefix(values, self.draft_s)
        return k if k and r > self.costs.all_ar_rate() else 0

    def _best_prefix(self, values: list[float], draft_s: float, per_token: float = 0.0,
                     costs: BatchCosts | None = None) -> tuple[int, float]:
        costs = costs or self.costs
        e = self.expected
        best, best_rate = 0, costs.rate(e, self.nodes, draft_s + per_token * (1 + e))
        room = max(self.max_nodes - self.nodes, 0)
        for k, v in enumerate(values[:room], 1):
            e += v
            r = costs.rate(e, self.nodes + k, draft_s + per_token * (1 + e))
            if r > best_rate:
                best, best_rate = k, r
        return best, best_rate

    def _worth_feeding(self, candidates: list[float], fed: list[float], tokens: int, ahead: int = 1,
                       top1: float | None = None) -> bool:
        """One more draft forward over `tokens` rows (feeding the nodes of values `fed`): worth it if the
        best tree reachable with it and up to `ahead` - 1 more forwards (`_ahead`) beats the best of
        the known `candidates` without it. The forward that would open the tree (none ran yet this
        step) carries the draft's catch-up, as in `could_pay`: a suffix tree is weighed against a
        draft that must first be prefilled. `top1` replaces the draft's running top-1 (Round.measure)."""
        rates = self._ahead(candidates, fed, tokens, max(ahead, 1), top1,
                            per_token=0.0 if self.rounds else self._catch_up())
        return max(rates[1:]) > rates[0]

    def _ahead(self, known: list[float], frontier: list[float], tokens: int, forwards: int,
               top1: float | None = None, per_token: float = 0.0, costs: BatchCosts | None = None) -> list[float]:
        """The best rate reachable after 0, 1, ... `forwards` more draft forwards: each forward gives
        every frontier node a guessed child of value v x top1 (the draft's recent calibrated top-1
        acceptance), and the tree takes the best prefix of the known candidates and the children so
        far (a child never outranks its parent, so every prefix is a tree). One step ahead is myopic
        where verify costs rise steeply from one token (a CPU: a 2-token forward can cost 2x a
        1-token one), so a deep tree that pays is never reached one unprofitable node at a time.
        `top1` replaces the running estimate (could_pay's optimistic draft); `per_token`: seconds
        charged per emitted token of a drafted step (could_pay's catch-up); `costs`: the batch it is
        weighed in, if not this step's."""
        costs = costs or self.costs
        top1 = self.values.top1 if top1 is None else top1
        values = sorted(known, reverse=True)
        draft_s, rates = self.draft_s, []
        for k in range(forwards + 1):
            if k:
                draft_s += costs.draft_marginal(tokens, len(self.rounds) + k - 1)
                frontier = [v * top1 for v in frontier]
                values = sorted(values + frontier, reverse=True)
            rates.append(self._best_prefix(values, draft_s, per_token if k else 0.0, costs)[1])
        return rates

    # -- after verification -----------------------------------------------------------------------
    def observe(self, proposal: Proposal, path: np.ndarray, emitted: int, seconds: float) -> dict:
        """The step's outcome: the tree verified (`proposal`, as the step sent it; its nodes' values and
        draft forwards: the ledger), its accepted `path`. Calibrates the request's Values, updates the
        gate; returns the step's record."""
        tree_size = len(proposal.tree)
        self._sync(self.ledger.tree, self.ledger.forwards)
        self.values.calibrate(tree_size, path, proposal.tree.host_parents, proposal.node_q, proposal.source)
        ar = self.costs.all_ar_rate()
        if self.left is not None:
            self.left -= emitted
        realized = self.costs.rate(emitted - 1, tree_size - 1, self.draft_s) / ar
        self.gate.observe(realized, self.nodes)
        if not self.rounds:                 # a free step: a suffix tree, or ar
            self.free_gain = (1 - FREE_EMA) * self.free_gain + FREE_EMA * realized
        record = step_record(self, tree_size, emitted, seconds, realized)
        # last: the batch view still holds the step before (the scheduler updates it after this phase)
        self.last_expected = 1 + self.expected
        return record
