"""budget: auto — size every step's tree from measured step costs and live acceptance estimates.

A step emits 1 + A tokens, A = the accepted drafts, and costs D (draft forwards) + V(n) (one target
forward over the root and n nodes; costs.py measures both). The policy grows a tree best-first and
adds a node only while it raises the step's expected rate

    r(n) = (1 + E[A]) / (D + V(n)),      E[A] = sum over the tree's nodes of P(node accepted)

i.e. the known candidates are added as the prefix (best value first) that maximises r, and a node
seen alone is added while its value v (the probability that it is reached and accepted) exceeds r
times the marginal verify cost V(n+1) - V(n). Both look ahead: a node (or a set of candidates to
feed) that does not pay as a leaf is still taken when the tree it would grow pays, its children
guessed as value x the draft's recent calibrated top-1 acceptance, over as many more draft forwards
as the strategy allows (`_ahead`; on a CPU a 2-token verify costs ~2x a 1-token one, so a deep
tree that pays is never reached one unprofitable node at a time). One more draft forward is paid
only if the best tree reachable with it beats the candidates already known. A step whose history
says no tree pays is a plain `ar` step (budget 0, `drafted` false), probing again after 1, 2, 4,
... 16 such steps (64 after a probe whose tree stayed empty; times the batch's rows: a probe pads
every row of the batch). In a batch the gate compares the batch's rate with trees against the
batch's rate if every request took an ar step. Before any of that, a step drafts only if some tree
could pay at the batch's costs with an optimistic draft (`could_pay`): in a batch of many one-token
rows none can (one request's tree pads them all), so a full batch runs ar with no probes and its
requests' drafts are never prefilled (request.py prefills a draft lazily, at its first drafted step).

P(node accepted) = product over its path of f(q): q is the draft's probability of the node's token
given its parent, and f is calibrated per request from every verified step (children of accepted
nodes: accepted or not), starting from DySpec's prior f(q) = q. Requests sharing a batch share the
target forward: V is taken at the batch's total tokens and r counts the batch's expected tokens
(`BatchView`, set by the scheduler; a forward over B rows padded to the longest costs what the
cost model measured for B such rows, for target and draft forwards alike), so every request adds a
node only while its value beats the same batch-wide threshold: the heap-over-all-requests
allocation in threshold form. The tree shrinks as the batch grows and grows back when it drains.

The policy decides which tree is verified, never how: verification is the same exact rule, so the
output is lossless whatever tree it chooses from the past (earlier outcomes, the draft's
probabilities). One rule keeps sampling exact: a child that is SAMPLED (chain, dyspec under
temperature) joins the tree or not before it is drawn (`draw_value`), never by which token it
turned out to be. Tests: every strategy with budget auto equals ar (greedy) and passes chi-square.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .costs import CostModel

EDGES = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0])
PRIOR = 4.0            # pseudo-observations per bin for the prior f(q) = q
EMA = 0.3              # weight of the newest step in the running gain of drafted steps
MAX_BACKOFF = 16       # at most this many ar steps in a row before a probe step drafts again ...
IDLE_BACKOFF = 64      # ... or this many after a probe whose tree was empty (it learned nothing)
HOPE_TOP1 = 0.9        # a step drafts only if a chain this good (each node accepted w.p. 0.9 given its
HOPE_FORWARDS = 8      # parent, or the request's own top-1 rate if higher, up to 8 draft forwards) could pay


class Acceptance:
    """f(q) = P(a drafted child is accepted | the draft gave it probability q): one Beta posterior per
    bin of q, prior mean the bin's centre (the draft is calibrated), updated from verified steps."""

    def __init__(self) -> None:
        centre = (EDGES[:-1] + EDGES[1:]) / 2
        self.hits = PRIOR * centre
        self.tries = np.full(len(centre), PRIOR)

    def _bins(self, q):
        """Bin of each q: host values (numpy), or a tensor's, computed where the tensor is."""
        if isinstance(q, torch.Tensor):
            edges = torch.as_tensor(EDGES, dtype=torch.float64, device=q.device)
            return (torch.bucketize(q.double(), edges, right=True) - 1).clamp_(0, len(self.hits) - 1)
        return np.clip(np.searchsorted(EDGES, np.asarray(q, dtype=np.float64), side="right") - 1, 0, len(self.hits) - 1)

    def __call__(self, q: float) -> float:
        b = self._bins(q)
        return float(self.hits[b] / self.tries[b])

    def expected(self, draw: torch.Tensor, q: torch.Tensor) -> float:
        """E[f(q(y))] for y drawn from `draw`: the value of a sampled child, known before it is drawn.
        Computed where the draft's probabilities are (one read: the result)."""
        rates = torch.as_tensor(self.hits / self.tries, device=q.device)
        return float((draw.double() * rates[self._bins(q)]).sum())

    def update(self, q: np.ndarray, accepted: np.ndarray) -> None:
        b = self._bins(q)
        np.add.at(self.tries, b, 1.0)
        np.add.at(self.hits, b, accepted.astype(np.float64))


@dataclass
class BatchView:
    """The scheduler's last iteration, by request id: each request's new tokens in the target
    forward (with its expected emitted tokens) and in each draft forward; a request that ends is
    forgotten; a request whose prefill is running is a one-token row (`join`). A policy reads its
    neighbours' entries. A forward over B rows is costed as the Batcher runs it: B rows padded to
    the longest."""
    target: dict[int, tuple[int, float]] = field(default_factory=dict)
    draft: list[dict[int, int]] = field(default_factory=list)     # per draft forward: tokens by request

    def observe(self, target: dict[int, tuple[int, float]], draft: list[dict[int, int]],
                coming: list[int] = ()) -> None:
        self.target, self.draft = target, draft
        self.join(coming)

    def join(self, requests: list[int]) -> None:
        """Requests about to take their first step (their prefill is running): one-token rows."""
        for r in requests:
            self.target.setdefault(r, (1, 1.0))

    def forget(self, request: int) -> None:
        self.target.pop(request, None)
        for rnd in self.draft:
            rnd.pop(request, None)


class AutoBudget:
    """One request's policy (lives in its DecodeState): begin() a step, then worth()/add() nodes,
    worth_feeding() a draft forward, draft_forward() when one runs; verification calls observe()."""

    def __init__(self, costs: CostModel, max_nodes: int, batch: BatchView | None = None, request: int = 0):
        self.costs, self.max_nodes = costs, max_nodes
        self.batch, self.request = batch or BatchView(), request     # the view, and this request's id in it
        self.f = Acceptance()
        self.gain: float | None = None      # running (EMA) realized gain of drafted steps over ar
        self.top1 = 0.5                     # running f(top-1 probability) at fed nodes
        self.ar_run, self.backoff = 0, 1
        self.idle = False                   # the last drafted step added no node
        self.own = (0, 0.0)                 # what this request sent to the last target phase
        self.rounds: list[int] = []         # this step's draft forwards so far (tokens each)
        self.cached = 0
        self.drafting = False
        self.draft_s, self.base_draft_s, self.expected, self.nodes = 0.0, 0.0, 0.0, 0

    # -- costs as this request sees them in its batch -------------------------------------------
    def _others(self) -> tuple[list[int], float]:
        """The neighbours' tokens in the last target forward, and their expected emitted tokens."""
        others = [v for r, v in self.batch.target.items() if r != self.request]
        return [t for t, _ in others], sum(e for _, e in others)

    def _padded(self, role: str, rows: list[int]) -> float:
        return self.costs.forward(role, rows, self.cached)

    def _round_others(self, k: int) -> list[int]:
        if k >= len(self.batch.draft):
            return []
        return [t for r, t in self.batch.draft[k].items() if r != self.request]

    def _draft_marginal(self, tokens: int, ahead: int = 0) -> float:
        """What one more draft forward of this request (`ahead` forwards after the next) adds to the
        batch's draft time: its row joins the neighbours' forward of the same round (padded), or is a
        forward of its own."""
        if self.costs.draft is None:
            return 0.0
        others = self._round_others(len(self.rounds) + ahead)
        return self._padded("draft", others + [tokens]) - self._padded("draft", others)

    def verify_s(self, nodes: int) -> float:
        """The batch's target forward with this request's tree of `nodes` + 1 tokens in it."""
        return self._padded("target", self._others()[0] + [nodes + 1])

    def rate(self, expected: float, nodes: int, draft_s: float) -> float:
        return (self._others()[1] + 1 + expected) / max(draft_s + self.verify_s(nodes), 1e-9)

    def all_ar_s(self) -> float:
        """The batch's target forward if every request in it took an ar step."""
        return self._padded("target", [1] * (len(self._others()[0]) + 1))

    def all_ar_rate(self) -> float:
        """The batch's rate if every request in it took an ar step: what drafting must beat. (Against
        the batch with only its own step made ar, each request would find its tree worth it, the
        batch waiting on its neighbours' drafts anyway, while the batch as a whole loses.)"""
        return (len(self._others()[0]) + 1) / max(self.all_ar_s(), 1e-9)

    # -- one step ---------------------------------------------------------------------------------
    def begin(self, cached: int) -> bool:
        """Start a step after `cached` committed tokens; False = make it a plain ar step."""
        self.cached = cached
        self.expected, self.nodes, self.rounds = 0.0, 0, []
        # the batch's draft time without this request: its neighbours' draft forwards (0 when alone)
        self.base_draft_s = (sum(self._padded("draft", self._round_others(k))
                                 for k in range(len(self.batch.draft))) if self.costs.draft else 0.0)
        self.draft_s = self.base_draft_s
        self.drafting = self.gain is None or self.gain >= 1.0
        if (self.drafting or self.ar_run >= self.backoff) and not self.could_pay():
            self.drafting = False                       # not in this batch, whatever the draft: ar,
            self.ar_run += 1                            # and a probe waits for the batch to drain
            return False
        if self.drafting:
            self.ar_run, self.backoff = 0, 1
        elif self.ar_run >= self.backoff:               # probe: draft once to re-measure acceptance
            self.drafting, self.ar_run = True, 0
            # a probe pads every row of the batch to its tree: rarer the more rows share the forward;
            # one whose tree stayed empty paid a draft forward (catching up) for nothing: rarer still
            cap = IDLE_BACKOFF if self.idle else MAX_BACKOFF
            self.backoff = min(2 * self.backoff, cap * (len(self._others()[0]) + 1))
        else:
            self.ar_run += 1
        return self.drafting

    def could_pay(self) -> bool:
        """Could any tree pay in this step at this batch's costs? An optimistic draft's chain (every
        node accepted w.p. HOPE_TOP1 given its parent, or the request's recent top-1 rate if higher)
        over up to HOPE_FORWARDS draft forwards must beat both the batch with everyone at ar and
        this request's own ar step. Alone on a CPU it always can (a measured one-token step of
        200 ms, a 2-token one of 226 ms); in a batch of many one-token rows it cannot (8 rows: one
        request's tree pads every row, 503 -> 590 ms for 2 tokens), so such a batch runs ar and
        probes nothing, and a lazily prefilled draft (request.py) is not even prefilled. Costs
        only: no acceptance history gates it, so a drained batch drafts again at once."""
        rates = self._ahead([], [1.0], 1, HOPE_FORWARDS, top1=max(self.top1, HOPE_TOP1))
        return max(rates[1:]) > max(rates[0], self.all_ar_rate())

    def opened(self, pending: int) -> None:
        """The draft forward that opens a tree over the `pending` tokens the draft has not seen. After
        ar steps those are many, once: charged as the usual lag of 2, so that catching up does not
        make the probe step look worse than drafting is."""
        self.draft_forward(min(pending, 2))

    def draft_forward(self, tokens: int) -> None:
        self.draft_s += self._draft_marginal(tokens)
        self.rounds.append(tokens)

    def value(self, parent_value: float, q: float) -> float:
        return parent_value * self.f(q)

    def draw_value(self, parent_value: float, draw: torch.Tensor, q: torch.Tensor) -> float:
        """The value of a child about to be SAMPLED from `draw` (q: the draft's distribution). Whether a
        sampled child joins the tree must not depend on which token it is (verification would no
        longer be exact), so the decision uses this expectation, made before the draw."""
        return parent_value * self.f.expected(draw, q)

    def saw_top1(self, q: float) -> None:
        self.top1 = (1 - EMA) * self.top1 + EMA * self.f(q)

    def worth(self, v: float, ahead: int = 0) -> bool:
        """Does a node of value v raise the step's expected rate, alone or (`ahead` > 0) with the
        chain of up to `ahead` more draft forwards it would open (see `_ahead`)?"""
        if self._worth(v, self.expected, self.nodes, self.draft_s):
            return True
        return ahead > 0 and max(self._ahead([v], [v], 1, ahead)) > self.rate(self.expected, self.nodes, self.draft_s)

    def _worth(self, v: float, expected: float, nodes: int, draft_s: float) -> bool:
        if nodes >= self.max_nodes:
            return False
        dv = self.verify_s(nodes + 1) - self.verify_s(nodes)
        return v * (draft_s + self.verify_s(nodes)) > (self._others()[1] + 1 + expected) * dv

    def take(self, values: list[float], width: int = 0, ahead: int = 0) -> int:
        """How many of the known candidates (values, best first) to add now: the prefix that maximises
        the step's rate. Not a marginal stop at the first loss: measured CPU costs have steps (GEMM
        blocking: 4 -> 8 tokens can cost less than 1 -> 2), so a longer prefix may pay where a shorter
        one does not. With `ahead` > 0, the best `width` of them are taken (to be fed) when the tree
        they would grow in up to `ahead` more draft forwards beats every prefix of leaves."""
        k, r = self._best_prefix(values, self.expected, self.nodes, self.draft_s)
        front = values[:width] if ahead > 0 else []
        if len(front) > k and max(self._ahead(values, front, len(front), ahead)) > r:
            return len(front)
        return k

    def _best_prefix(self, values: list[float], expected: float, nodes: int, draft_s: float) -> tuple[int, float]:
        best, best_rate, e = 0, self.rate(expected, nodes, draft_s), expected
        room = max(self.max_nodes - nodes, 0)
        for k, v in enumerate(values[:room], 1):
            e += v
            r = self.rate(e, nodes + k, draft_s)
            if r > best_rate:
                best, best_rate = k, r
        return best, best_rate

    def add(self, v: float) -> None:
        self.expected += v
        self.nodes += 1

    def worth_feeding(self, candidates: list[float], fed: list[float], tokens: int, ahead: int = 1) -> bool:
        """One more draft forward over `tokens` rows (feeding the nodes of values `fed`): worth it if the
        best tree reachable with it and up to `ahead` - 1 more forwards (`_ahead`) beats the best of
        the known `candidates` without it."""
        rates = self._ahead(candidates, fed, tokens, max(ahead, 1))
        return max(rates[1:]) > rates[0]

    def _ahead(self, known: list[float], frontier: list[float], tokens: int, forwards: int,
               top1: float | None = None) -> list[float]:
        """The best rate reachable after 0, 1, ... `forwards` more draft forwards: each forward gives
        every frontier node a guessed child of value v x top1 (the draft's recent calibrated top-1
        acceptance), and the tree takes the best prefix of the known candidates and the children so
        far (a child never outranks its parent, so every prefix is a tree). One step ahead is myopic
        where verify costs rise steeply from one token (a CPU: a 2-token forward can cost 2x a
        1-token one), so a deep tree that pays is never reached one unprofitable node at a time.
        `top1` replaces the running estimate (could_pay's optimistic draft)."""
        top1 = self.top1 if top1 is None else top1
        values = sorted(known, reverse=True)
        draft_s, rates = self.draft_s, []
        for k in range(forwards + 1):
            if k:
                draft_s += self._draft_marginal(tokens, k - 1)
                frontier = [v * top1 for v in frontier]
                values = sorted(values + frontier, reverse=True)
            rates.append(self._best_prefix(values, self.expected, self.nodes, draft_s)[1])
        return rates

    # -- after verification -----------------------------------------------------------------------
    def observe(self, tree_size: int, path: np.ndarray, parents: np.ndarray, node_q: np.ndarray | None,
                emitted: int, seconds: float) -> dict:
        """Update f from the children of accepted nodes; returns the step's record."""
        on_path = np.zeros(tree_size, dtype=bool)
        on_path[path] = True
        if node_q is not None and tree_size > 1:
            tested = np.flatnonzero((parents >= 0) & on_path[np.maximum(parents, 0)] & ~np.isnan(node_q))
            if len(tested):
                self.f.update(node_q[tested], on_path[tested])
        ar = self.all_ar_rate()
        predicted = self.rate(self.expected, self.nodes, self.draft_s) / ar
        realized = self.rate(emitted - 1, tree_size - 1, self.draft_s) / ar
        if self.drafting:
            self.idle = self.nodes == 0
            self.gain = realized if self.gain is None else (1 - EMA) * self.gain + EMA * realized
        ar_s = self.all_ar_s()
        measured = emitted * ar_s / seconds if seconds > 0 else None
        record = {"drafted": self.drafting, "budget": self.nodes, "expected_accepted": round(self.expected, 3),
                  "predicted_gain": round(predicted, 3), "measured_gain": _round(measured),
                  "modelled_gain": round(realized, 3),
                  # the step's time and an ar step's, by the cost table (bench --plan-costs: a projection)
                  "modelled_s": round(self.draft_s + self.verify_s(tree_size - 1), 6), "ar_s": round(ar_s, 6)}
        # last: the batch view still holds the step before (the scheduler updates it after this phase)
        self.own = (tree_size, 1 + self.expected)       # what the scheduler records for this step
        return record


def _round(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 3)
