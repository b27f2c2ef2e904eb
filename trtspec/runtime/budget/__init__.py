"""The budget: how big each step's tree may grow. Every request has one, so strategies never ask
whether a policy exists; they ask the budget.

- `FixedBudget`: the strategy's own numbers (k, budget, width...) bound the tree; every node and
  draft forward is worth it, a node's value is its cumulative draft probability.
- `AutoBudget` (auto.py, `budget: auto`): sized every step from measured costs and calibrated
  acceptance, over four small parts: batch costs (batch_costs.py), the ar gate with back-off
  (gate.py), node valuation with lookahead (auto.py), step records (records.py).

Both answer the same questions (`Budget`). The budget only chooses which tree is verified; the
shared step verifies it exactly, so every budget is lossless.
"""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np
import torch

from ..costs import CostModel
from .acceptance import Acceptance
from .auto import AutoBudget
from .batch_costs import BatchCosts, BatchView


class Budget(Protocol):
    adaptive: bool           # True: sized from costs (its draft is prefilled lazily, at the first drafted step)
    top1: float              # the draft's recent calibrated top-1 acceptance

    def begin(self, cached: int, behind: int = 0) -> bool: ...   # draft this step? (False: a plain ar step)
    def opened(self, pending: int) -> None: ...               # the draft forward that opened the tree
    def draft_forward(self, tokens: int) -> None: ...         # a draft forward ran
    def value(self, parent_value: float, q: float, suffix: bool = False) -> float: ...
    def draw_value(self, parent_value: float, draw: torch.Tensor, q: torch.Tensor) -> float: ...
    def saw_top1(self, q: float) -> None: ...
    def worth(self, v: float, ahead: int = 0) -> bool: ...    # add a node of value v?
    def take(self, values: list[float], width: int = 0, ahead: int = 0) -> int: ...   # how many candidates
    def take_free(self, values: list[float]) -> int: ...     # ... of a tree that costs no draft forward
    def add(self, v: float) -> None: ...                      # a node joined the tree
    def worth_feeding(self, candidates: list[float], fed: list[float], tokens: int, ahead: int = 1) -> bool: ...
    def observe(self, tree_size: int, path: np.ndarray, parents: np.ndarray,
                node_q: Callable[[], np.ndarray] | None, emitted: int, seconds: float,
                source: np.ndarray | None = None) -> dict: ...
    def expected_emitted(self) -> float: ...


class FixedBudget:
    """The strategy's fixed numbers bound the tree: every node and every draft forward is worth it."""
    adaptive = False
    top1 = 1.0

    def begin(self, cached: int, behind: int = 0) -> bool:
        return True

    def opened(self, pending: int) -> None:
        pass

    def draft_forward(self, tokens: int) -> None:
        pass

    def value(self, parent_value: float, q: float, suffix: bool = False) -> float:
        return parent_value * q                   # the cumulative draft (or suffix) probability

    def draw_value(self, parent_value: float, draw: torch.Tensor, q: torch.Tensor) -> float:
        return parent_value

    def saw_top1(self, q: float) -> None:
        pass

    def worth(self, v: float, ahead: int = 0) -> bool:
        return True

    def take(self, values: list[float], width: int = 0, ahead: int = 0) -> int:
        return len(values)

    def take_free(self, values: list[float]) -> int:
        return len(values)

    def add(self, v: float) -> None:
        pass

    def worth_feeding(self, candidates: list[float], fed: list[float], tokens: int, ahead: int = 1) -> bool:
        return True

    def observe(self, tree_size, path, parents, node_q, emitted, seconds, source=None) -> dict:
        return {}

    def expected_emitted(self) -> float:
        return 1.0


def make_budget(auto_nodes: int | None, costs: CostModel | None, batch: BatchView | None = None,
                request: int = 0, left: int | None = None) -> Budget:
    """AutoBudget for a strategy with `budget: auto` (its cap `auto_nodes`) when step costs are known,
    else the strategy's fixed numbers. `left`: the most tokens the request will emit."""
    if auto_nodes is None or costs is None:
        return FixedBudget()
    return AutoBudget(costs, auto_nodes, batch, request, left)


__all__ = ["Acceptance", "AutoBudget", "BatchCosts", "BatchView", "Budget", "FixedBudget", "make_budget"]
