"""What a step costs one request in its batch: the scheduler's view of the last iteration, and the
cost model read at the batch's padded shapes.

Requests sharing a batch share the target forward: V is taken at the batch's total tokens and the
rate counts the batch's expected tokens, so every request adds a node only while its value beats
the same batch-wide threshold (the heap-over-all-requests allocation in threshold form). A forward
over B rows padded to the longest costs what the cost model measured for B such rows, for target
and draft forwards alike. A draft's catch-up (a forward over every token it lacks) pays only over
many steps, so it is also weighed in the batch as the last RECENT iterations had it (`recent`): a
request alone for an iteration because its neighbour's next request has not arrived yet does not
prefill a draft it will not use once that request joins.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..costs import CostModel

# Target phases a catch-up looks back over. Measured (8 HumanEval requests, 2 closed-loop clients,
# the default pair): between one request's end and its client's next submit the scheduler ran an
# iteration with one row, where a draft pays; each of the 8 requests prefilled its draft there
# (1.4-1.6 s of 41-46) for 7 draft forwards in all, and the wave ran at 0.87-0.97x ar's; with this
# look-back, 2 prefills and 0.99-1.05x (docs/benchmarks.md, "The default under load").
RECENT = 8


@dataclass
class BatchView:
    """The scheduler's last iteration, by request id: each request's new tokens in the target
    forward (with its expected emitted tokens) and in each draft forward; a request that ends is
    forgotten; a request whose prefill is running is a one-token row (`join`); the rows of the last
    RECENT target phases (none once no request is left). A budget reads its neighbours' entries."""
    target: dict[int, tuple[int, float]] = field(default_factory=dict)
    draft: list[dict[int, int]] = field(default_factory=list)     # per draft forward: tokens by request
    sizes: deque = field(default_factory=lambda: deque(maxlen=RECENT))    # rows of the last target phases

    def observe(self, target: dict[int, tuple[int, float]], draft: list[dict[int, int]],
                coming: list[int] = ()) -> None:
        self.target, self.draft = target, draft
        self.join(coming)
        self.sizes.append(len(self.target))
        self._drained()

    def recent_rows(self) -> int:
        """The most rows a target phase had in the last RECENT iterations (1 before any)."""
        return max(self.sizes, default=1)

    def join(self, requests: list[int]) -> None:
        """Requests about to take their first step (their prefill is running): one-token rows."""
        for r in requests:
            self.target.setdefault(r, (1, 1.0))

    def forget(self, request: int) -> None:
        self.target.pop(request, None)
        for rnd in self.draft:
            rnd.pop(request, None)
        self._drained()

    def _drained(self) -> None:
        """No request left: the next one starts a batch of its own, with no recent sizes."""
        if not self.target:
            self.sizes.clear()


class BatchCosts:
    """Step costs as request `request` sees them in its batch, after `cached` committed tokens."""

    def __init__(self, costs: CostModel, batch: BatchView, request: int, heads=()):
        self.model, self.batch, self.request = costs, batch, request
        self.cached = 0
        self.heads = [costs.heads[k] for k in sorted(heads) if k in costs.heads]   # the head roles it asks

    def others(self) -> tuple[list[int], float]:
        """The neighbours' tokens in the last target forward, and their expected emitted tokens."""
        others = [v for r, v in self.batch.target.items() if r != self.request]
        return [t for t, _ in others], sum(e for _, e in others)

    def rows(self) -> int:
        """Rows of the batch's target forward, this request's included."""
        return len(self.others()[0]) + 1

    def recent(self) -> "BatchCosts | None":
        """The same request's costs in a batch of as many rows as the recent iterations had at most
        (one-token neighbours), or None where that is not more than this batch's rows."""
        n = self.batch.recent_rows()
        if n <= self.rows():
            return None
        view = BatchView({-i: (1, 1.0) for i in range(1, n)}, [])
        costs = BatchCosts(self.model, view, self.request)
        costs.cached, costs.heads = self.cached, self.heads
        return costs

    def padded(self, role: str, rows: list[int]) -> float:
        return self.model.forward(role, rows, self.cached)

    def round_others(self, k: int) -> list[int]:
        if k >= len(self.batch.draft):
            return []
        return [t for r, t in self.batch.draft[k].items() if r != self.request]

    def neighbours_draft_s(self) -> float:
        """The batch's draft time without this request: its neighbours' draft forwards (0 when alone)."""
        if self.model.draft is None:
            return 0.0
        return sum(self.padded("draft", self.round_others(k)) for k in range(len(self.batch.draft)))

    def draft_marginal(self, tokens: int, round_: int) -> float:
        """What one more draft forward of this request, its `round_`-th of the step, adds to the batch's
        draft time: its row joins the neighbours' forward of the same round (padded), or is a forward
        of its own."""
        if self.model.draft is None:
            return 0.0
        others = self.round_others(round_)
        return self.padded("draft", others + [tokens]) - self.padded("draft", others)

    def verify_s(self, nodes: int) -> float:
        """The batch's target forward with this request's tree of `nodes` + 1 tokens in it."""
        return self.padded("target", self.others()[0] + [nodes + 1])

    def rate(self, expected: float, nodes: int, draft_s: float) -> float:
        """The batch's tokens per second with this request's tree (`nodes`, `expected` accepted)."""
        return (self.others()[1] + 1 + expected) / max(draft_s + self.verify_s(nodes) + self.heads_s(), 1e-9)

    def heads_s(self) -> float:
        """The forward of each head role the request asks, over the batch's rows: made every step, a
        tree or not (its drafter's `prepare` runs before the plan), so it is in every rate."""
        return sum(t(self.rows()) for t in self.heads) if self.heads else 0.0

    def all_ar_s(self) -> float:
        """The batch's target forward if every request in it took an ar step (and its head forwards)."""
        return self.padded("target", [1] * self.rows()) + self.heads_s()

    def all_ar_rate(self) -> float:
        """The batch's rate if every request in it took an ar step: what drafting must beat. (Against
        the batch with only its own step made ar, each request would find its tree worth it, the
        batch waiting on its neighbours' drafts anyway, while the batch as a whole loses.)"""
        return self.rows() / max(self.all_ar_s(), 1e-9)
