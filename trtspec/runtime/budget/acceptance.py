"""Acceptance: f(q) = P(a drafted child is accepted | the draft gave it probability q), calibrated per
request from every verified step, starting from DySpec's prior f(q) = q, or from what earlier requests
learned (`carry`: a suffix trie's scores, calibrated per scope across requests)."""
from __future__ import annotations

import numpy as np
import torch

EDGES = np.array([0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0])
PRIOR = 4.0            # pseudo-observations per bin for the prior f(q) = q


class Acceptance:
    """One Beta posterior per bin of q, prior mean the bin's centre (the draft is calibrated), updated
    from verified steps."""

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

    def expected(self, draw: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """E[f(q(y))] for y drawn from `draw`: the value of a sampled child, known before it is drawn.
        Computed where the draft's probabilities are: a float64 scalar there, for the caller to read
        (with others: dyspec reads a round's children's at once)."""
        rates = torch.as_tensor(self.hits / self.tries, device=q.device)
        return (draw.double() * rates[self._bins(q)]).sum()

    def update(self, q: np.ndarray, accepted: np.ndarray) -> None:
        b = self._bins(q)
        np.add.at(self.tries, b, 1.0)
        np.add.at(self.hits, b, accepted.astype(np.float64))

    def copy(self) -> Acceptance:
        out = Acceptance()
        out.hits, out.tries = self.hits.copy(), self.tries.copy()
        return out

    def carry(self, other: Acceptance, most: float) -> None:
        """Start from `other`'s estimates, each bin believed as at most `most` observations (so this
        request still learns its own within a few steps)."""
        scale = np.minimum(1.0, most / other.tries)
        self.hits, self.tries = other.hits * scale, other.tries * scale

    def absorb(self, now: Acceptance, then: Acceptance, most: float) -> None:
        """Add what a request observed (its estimates `now` less those it started from, `then`), each
        bin kept to at most `most` observations (older ones weigh less: the estimate follows the
        traffic)."""
        self.hits = self.hits + (now.hits - then.hits)
        self.tries = self.tries + (now.tries - then.tries)
        scale = np.minimum(1.0, most / self.tries)
        self.hits, self.tries = self.hits * scale, self.tries * scale
