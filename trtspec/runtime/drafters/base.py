"""Drafter: a part that proposes candidate tokens at no model call, for any strategy to grow trees from.

A strategy is a policy over drafters: it asks them for candidates, values and sizes its tree with the
request's Values and budget, and hands the tree to the shared step. A drafter only proposes.

- `chain(st, context, n)`: its most likely continuation of `context` (up to `n` tokens): the cheap
  chain a draft model reviews (staged's stage 2, cascade's levels) or a chain verified as it is
  (the `ngram` strategy).
- `candidates(st, cap)`: (the length of the match it drafts from, up to `cap` scored candidates
  best first), a tree from the root: each candidate's parent comes before it and its value is at
  most its parent's, so any prefix is a tree. Only a `scored` drafter has them: its scores are
  calibrated apart from every other drafter's (Values, by the drafter's `tag`); an unscored one
  proposes chains only.
- `finished(st, prompt, output)`: a request ended normally: what the drafter may learn from it.

Per-request state lives in the request's DecodeState (`st.strategy_state`, under the drafter's
name), never on the drafter, which a strategy shares between requests. Every node a drafter
proposes carries its `tag`, so the step's `sources` report counts it under its name. Drafters are
deterministic: verified with q = one-hot, they are lossless whatever they propose.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..budget import Round
from ..decode import DecodeState
from ..proposal import Proposal, tag
from ..tree import TokenTree


@dataclass(frozen=True)
class Candidate:
    parent: int          # index of the parent candidate in the list; -1: the root (last emitted token)
    token: int
    prob: float          # the drafter's score: its probability given the parent, before calibration
    value: float         # the budget's value: P(reached and accepted)


class Drafter:
    name = "base"
    scored = False       # `candidates` gives scored trees (else chains only)

    def __init__(self, scope: str = "default") -> None:
        self.scope = scope            # what a drafter that learns across requests shares them by

    @cached_property
    def tag(self) -> int:
        """Its nodes' source (proposal.SOURCES): its name."""
        return tag(self.name)

    def chain(self, st: DecodeState, context: np.ndarray, n: int) -> list[int]:
        raise NotImplementedError

    def candidates(self, st: DecodeState, cap: int) -> tuple[int, list[Candidate]]:
        return 0, []

    def finished(self, st: DecodeState, prompt: list[int], output: list[int]) -> None:
        pass

    def stats(self, matched: int) -> dict:
        """What a step that drew on its candidates reports of them: the length of their match."""
        return {f"{self.name}_match": matched} if self.scored else {}

    def alone(self, st: DecodeState, cap: int) -> Proposal:
        """A step's tree of this drafter's candidates alone (up to `cap` nodes; see `tree`)."""
        return self.tree(st, *self.candidates(st, cap))

    def tree(self, st: DecodeState, matched: int, cands: list[Candidate]) -> Proposal:
        """The candidates alone as the step's tree: the prefix of them (best first) that maximises the
        step's expected rate by the budget, if that beats the batch all at ar (all of them with a
        fixed budget)."""
        cands = cands[: st.budget.plan(Round(known=[c.value for c in cands], free=True)).take]
        tree = TokenTree([st.root] + [c.token for c in cands], [-1] + [c.parent + 1 for c in cands])
        node_q = np.array([np.nan] + [c.prob for c in cands])
        return Proposal(tree, node_q=lambda: node_q, stats=self.stats(matched),
                        source=np.full(len(tree), self.tag, dtype=np.int64), values=[c.value for c in cands])
