"""Medusa (`medusa`): candidates from a Medusa head role (export/head.py) reading the target's hidden rows.

Before each step (`prepare`) the head reads the last of `st.hidden`, the row whose logits chose the
root, in one forward with the phase's other requests' rows (heads.ask); head k's top-k are its
guesses of the token k places after the root. `candidates` grows the tree best-first, each depth's
guesses under every node of the depth above (Medusa's tree), a node valued by the request's Values
from its parent's value and its probability, under the drafter's own tag (calibrated apart from the
draft's). `chain` is the heads' top-1 path, after the root or after a context that follows it.
Deterministic proposals: verified with q = one-hot, lossless whatever the head proposes.
"""
from __future__ import annotations

import heapq
import itertools

import numpy as np

from ..decode import DecodeState
from ..effects import Calls, ask
from ..heads import TOP_K
from .base import Candidate, Drafter


class Medusa(Drafter):
    name = "medusa"
    scored = True
    reads_hidden = True
    reads_head = "medusa"

    def __init__(self, scope: str = "default", top_k: int = TOP_K, min_prob: float = 0.01):
        super().__init__(scope)
        self.top_k, self.min_prob = top_k, min_prob

    def prepare(self, st: DecodeState) -> Calls:
        """The head's top-k after the root, kept for this step (st.strategy_state, under its name)."""
        st.strategy_state.pop(self.name, None)
        if st.hidden is None:
            return
        head = st.heads[self.reads_head]            # there: strategies.check refuses a strategy without it
        probs, toks = yield from ask(head, st.hidden[-1:], self.top_k)
        st.strategy_state[self.name] = (st.n_tokens, probs[0], toks[0])

    def _guesses(self, st: DecodeState):
        got = st.strategy_state.get(self.name)
        return None if got is None or got[0] != st.n_tokens else got[1:]

    def candidates(self, st: DecodeState, cap: int) -> tuple[int, list[Candidate]]:
        """(0, up to `cap` candidates best first): depth d's guesses under each node at depth d - 1."""
        got = self._guesses(st)
        if got is None:
            return 0, []
        probs, toks = got
        out: list[Candidate] = []
        heap: list = []
        order = itertools.count()

        def push(parent: int, value: float, depth: int) -> None:
            if depth >= len(probs):
                return
            for p, tok in zip(probs[depth], toks[depth]):
                v = st.values.child(value, p, self.tag)
                if v >= self.min_prob:
                    heapq.heappush(heap, (-v, next(order), parent, tok, p, depth))

        push(-1, 1.0, 0)
        while heap and len(out) < cap:
            neg, _, parent, tok, p, depth = heapq.heappop(heap)
            out.append(Candidate(parent, tok, p, -neg))
            push(len(out) - 1, -neg, depth + 1)
        return 0, out

    def chain(self, st: DecodeState, context: np.ndarray, n: int) -> list[int]:
        """The heads' top-1 tokens after `context`, where it is the sequence followed by their first ones."""
        got = self._guesses(st)
        if got is None or len(context) < st.n_tokens:
            return []
        top1 = [t[0] for t in got[1]]
        ahead = [int(t) for t in context[st.n_tokens:]]
        if ahead != top1[: len(ahead)]:
            return []
        return top1[len(ahead):len(ahead) + n]
