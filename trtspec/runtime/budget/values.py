"""Values: what a node is worth to one request, P(it is reached and accepted), from its drafter's score.

Proposers score their candidates with these (a child's value is its parent's times the calibrated
acceptance of its score); the budget then sizes the tree from the scored candidates (`Budget.plan`).
Scoring and sizing are apart: a proposer never asks the budget what a token is worth, and the budget
never reads a drafter's internals.

- calibrated (budget: auto): f(q) per drafter (the draft model's probabilities, `f`, also for the
  chains it reviewed; each scored drafter's own scores, `of(tag)`: e.g. a suffix trie's empirical
  probabilities), learned from every verified step (`calibrate`, called by the budget's
  `observe`), and the draft's running calibrated top-1 acceptance (`top1`: what the budget's
  look-ahead guesses a fed node's best child is worth; its prior 0.5 until the first fed node, or
  replaced by one measurement, `measure_top1`, where a drafter beside the draft offers a tree every
  step and the prior would keep the draft from ever running).
- uncalibrated (a fixed budget): a value is the cumulative draft (or drafter's) probability, and a
  sampled child is worth its parent (every node of a fixed tree is taken anyway).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ..proposal import DRAFT, REVIEW
from .acceptance import Acceptance
from .gate import EMA


class Values:
    def __init__(self, calibrated: bool = True):
        self.calibrated = calibrated
        self.f = Acceptance() if calibrated else None          # the draft model's (and reviewed chains')
        self.scored: dict[int, Acceptance] = {}                # each other drafter's, by its tag
        self.top1 = 0.5 if calibrated else 1.0                 # running f(top-1 probability) at fed nodes
        self.top1_seen = 0                                     # fed nodes it has seen (0: the prior alone)

    def of(self, source: int) -> Acceptance | None:
        """The calibration of the scores of `source` (proposal.SOURCES): the draft model's for its own
        nodes and the chains it reviewed, each other drafter's own (made on first use); None when
        values are uncalibrated."""
        if not self.calibrated:
            return None
        if source in (DRAFT, REVIEW):
            return self.f
        if source not in self.scored:
            self.scored[source] = Acceptance()
        return self.scored[source]

    def child(self, parent_value: float, q: float, source: int = DRAFT) -> float:
        """A child's value: its parent's times the calibrated acceptance of its score `q` (the draft's
        probability, or the score of the drafter `source`)."""
        if not self.calibrated:
            return parent_value * q
        return parent_value * (self.f if source == DRAFT else self.of(source))(q)

    def drawn(self, parent_value: float, draw: torch.Tensor, q: torch.Tensor) -> float:
        """The value of a child about to be SAMPLED from `draw` (q: the draft's distribution). Whether a
        sampled child joins the tree must not depend on which token it is (verification would no
        longer be exact), so the decision uses this expectation, made before the draw."""
        return parent_value * float(self.expected(draw, q)) if self.calibrated else parent_value

    def expected(self, draw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """A sampled child's value over its parent's (`drawn`), on the device, unread: E[f(q(y))] for y
        drawn from `draw`. Calibrated values only (uncalibrated, a sampled child is worth its parent)."""
        return self.f.expected(draw, q)

    def saw_top1(self, q) -> None:
        """A fed node's top-1 draft probability (a float, or a device scalar: read only when calibrated)."""
        if self.calibrated:
            self.top1 = (1 - EMA) * self.top1 + EMA * self.f(float(q))
            self.top1_seen += 1

    def measure_top1(self, q) -> None:
        """The draft's first top-1 probability, where the request had no view of its draft: it replaces
        the prior (which alone may keep the draft from ever being fed, so from ever being measured)."""
        if self.calibrated and not self.top1_seen:
            self.top1 = self.f(float(q))
            self.top1_seen = 1

    def calibrate(self, tree_size: int, path: np.ndarray, parents: np.ndarray,
                  node_q: Callable[[], np.ndarray] | None, source: np.ndarray | None = None) -> None:
        """Learn f from the children of accepted nodes (`node_q()`: each node's score given its parent,
        NaN where none; `source`: who proposed it, so each drafter's scores calibrate its own f)."""
        if not self.calibrated or node_q is None or tree_size < 2:
            return
        on_path = np.zeros(tree_size, dtype=bool)
        on_path[path] = True
        q = node_q()
        tested = (parents >= 0) & on_path[np.maximum(parents, 0)] & ~np.isnan(q)
        src = np.full(tree_size, DRAFT) if source is None else np.where(np.asarray(source) == REVIEW, DRAFT, source)
        for s in np.unique(src[tested]).tolist():
            mine = tested & (src == s)
            self.of(s).update(q[mine], on_path[mine])
