"""The budget: how big each step's tree may grow. Every request has one, so strategies never ask
whether a policy exists; they ask the budget.

- `FixedBudget`: the strategy's own numbers (k, budget, width...) bound the tree; every node and
  draft forward is worth it, a node's value is its cumulative draft probability.
- `AutoBudget` (auto.py, `budget: auto`): sized every step from measured costs and calibrated
  acceptance, over five small parts: batch costs (batch_costs.py), the ar gate with back-off
  (gate.py), node values (values.py), the plan with lookahead (auto.py), step records (records.py).

Both answer the same questions (`Budget`): the shared step begins a step and observes its outcome;
a proposer asks `plan(Round)` once per round of drafting (plan.py: how many of these scored
candidates to take, whether the draft forward that would feed them pays, and the bars a node found
later in the round must pass; with the tree's values and the step's draft forwards so far as facts).
Proposers score candidates with the request's `Values` (values.py), which its budget owns
(`budget.values`, read as `state.values`) and calibrates; nothing outside this package reads anything else of a budget (tests/unit/test_layers.py). The budget
only chooses which tree is verified; the shared step verifies it exactly, so every budget is
lossless.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..costs import CostModel
from .acceptance import Acceptance
from .auto import AutoBudget
from .batch_costs import BatchCosts, BatchView
from .plan import Ledger, Plan, Round
from .values import Values

if TYPE_CHECKING:
    from ..proposal import Proposal


class Budget(Protocol):
    adaptive: bool           # True: sized from costs (its draft is prefilled lazily, at the first drafted step)
    values: Values           # how the request's proposers score candidates (calibrated by an adaptive one)
    ledger: Ledger           # this step's facts, as its proposer records them (a fresh one at each begin)

    def begin(self, cached: int, behind: int = 0) -> bool: ...   # draft this step? (False: a plain ar step)
    def plan(self, r: Round) -> Plan: ...                       # what to take, whether to feed, the bars
    def observe(self, proposal: Proposal, path: np.ndarray, emitted: int, seconds: float) -> dict: ...
    def expected_emitted(self) -> float: ...                    # the last step's (the scheduler's batch view)


class FixedBudget:
    """The strategy's fixed numbers bound the tree: every node and every draft forward is worth it."""
    adaptive = False

    def __init__(self) -> None:
        self.values = Values(calibrated=False)       # a node's value: its cumulative draft probability
        self.ledger = Ledger()

    def begin(self, cached: int, behind: int = 0) -> bool:
        self.ledger = Ledger()
        return True

    def plan(self, r: Round) -> Plan:
        take = 0 if r.rows else len(r.known)
        feed = r.rows > 0 or (take > 0 and r.then is not None)
        return Plan(take, feed, () if r.bar_ahead is None else (float("-inf"),))

    def observe(self, proposal: Proposal, path: np.ndarray, emitted: int, seconds: float) -> dict:
        return {}

    def expected_emitted(self) -> float:
        return 1.0


def make_budget(auto_nodes: int | None, costs: CostModel | None, batch: BatchView | None = None,
                request: int = 0, left: int | None = None, heads=()) -> Budget:
    """A request's budget, which holds the Values its proposers score candidates with: AutoBudget for a strategy with `budget: auto` (its cap `auto_nodes`) when step costs are
    known, else the strategy's fixed numbers. `left`: the most tokens the request will emit; `heads`:
    the kinds of head role its drafters ask (their forwards are in every step's cost)."""
    if auto_nodes is None or costs is None:
        return FixedBudget()
    return AutoBudget(costs, auto_nodes, batch, request, left, heads=heads)


__all__ = ["Acceptance", "AutoBudget", "BatchCosts", "BatchView", "Budget", "FixedBudget", "Ledger", "Plan", "Round",
           "Values", "make_budget"]
