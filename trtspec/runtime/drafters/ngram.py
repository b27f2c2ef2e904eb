"""NGram (`ngram`): CS Drafting's MaG (max-gram), the longest earlier match's continuation.

Unscored (a copy has no probability to calibrate): it proposes chains, for a draft model to review
(staged's stage 2, cascade's levels) or to verify as they are (the `ngram` strategy). Free and
stateless: it reads the request's sequence (or the context it is given) each time.

The matcher (`MaxGram`) finds the longest suffix of the sequence (prompt + output) that occurred
earlier and copies the tokens that followed it. An optional greedy bigram table (token -> most
likely next token) fills in when nothing matches. Vectorized over candidate positions: one numpy
comparison per suffix length tried.
"""
from __future__ import annotations

import numpy as np

from ..decode import DecodeState
from .base import Drafter


class MaxGram:
    """The matcher: the longest earlier match of the sequence's suffix, and what followed it."""

    def __init__(self, max_ngram: int = 32, min_ngram: int = 1, occurrence: str = "latest",
                 bigram: np.ndarray | None = None):
        if occurrence not in ("latest", "earliest"):
            raise ValueError("occurrence must be 'latest' or 'earliest'")
        self.max_ngram, self.min_ngram, self.occurrence = max_ngram, min_ngram, occurrence
        self.bigram = bigram

    def match(self, seq: np.ndarray) -> int:
        """End index of the chosen earlier occurrence of the longest matching suffix, or -1."""
        n_seq = len(seq)
        if n_seq < 2:
            return -1
        ends = np.flatnonzero(seq[:-1] == seq[-1])       # occurrences of the last token
        n = 1
        while n < self.max_ngram and n < n_seq - 1:
            ok = ends >= n                                # room for one more token on the left
            nxt = ends[ok][seq[ends[ok] - n] == seq[-1 - n]]
            if nxt.size == 0:
                break
            ends, n = nxt, n + 1
        if ends.size == 0 or n < self.min_ngram:
            return -1
        return int(ends.max() if self.occurrence == "latest" else ends.min())

    def propose(self, seq: np.ndarray, k: int) -> list[int]:
        out: list[int] = []
        work = seq
        while len(out) < k:
            end = self.match(work)
            if end < 0:
                break
            copied = work[end + 1:end + 1 + k - len(out)].tolist()
            out += copied
            work = np.concatenate([seq, np.asarray(out, dtype=seq.dtype)])
        while self.bigram is not None and len(out) < k:
            last = out[-1] if out else int(seq[-1])
            if last >= len(self.bigram):          # a table shorter than the vocabulary has no entry
                break
            out.append(int(self.bigram[last]))
        return out


class NGram(Drafter):
    name = "ngram"

    def __init__(self, scope: str = "default", min_ngram: int = 1, bigram: np.ndarray | None = None):
        super().__init__(scope)
        self.matcher = MaxGram(min_ngram=min_ngram, bigram=bigram)

    def chain(self, st: DecodeState, context: np.ndarray, n: int) -> list[int]:
        return self.matcher.propose(np.asarray(context), n)
