"""NGram (`ngram`): CS Drafting's MaG, the longest earlier match's continuation (runtime/ngram.py).

Unscored (a copy has no probability to calibrate): it proposes chains, for a draft model to review
(staged's stage 2, cascade's levels) or to verify as they are (the `ngram` strategy). Free and
stateless: it reads the request's sequence (or the context it is given) each time.
"""
from __future__ import annotations

import numpy as np

from ..decode import DecodeState
from ..ngram import NGramDrafter
from .base import Drafter


class NGram(Drafter):
    name = "ngram"

    def __init__(self, scope: str = "default", min_ngram: int = 1, bigram: np.ndarray | None = None):
        super().__init__(scope)
        self.matcher = NGramDrafter(min_ngram=min_ngram, bigram=bigram)

    def chain(self, st: DecodeState, context: np.ndarray, n: int) -> list[int]:
        return self.matcher.propose(np.asarray(context), n)
