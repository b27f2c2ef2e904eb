"""suffix: SuffixDecoding (Oliaro et al.): a token tree from suffix tries, with no model call.

The candidates come from the request's own trie and its scope's global trie (drafters/suffix.py:
matching, scoring, the global trie's scope and memory cap; ~270 bytes a node, so the default
`global_nodes` of 500k is ~135 MB). With `budget: auto` (the default; cap `max_budget`) the budget
values each candidate by its calibrated empirical probability (acceptance is learned apart from any
draft model's, per request, starting from what the scope's earlier requests measured) and verifies the best-first prefix that maximises the step's expected
rate; with a number it is the node budget. The tree costs no model call, so it is proposed even in
steps where the ar gate finds no draft forward worth paying (a crowded batch). Children are
deterministic (q = one-hot under sampling): lossless like every strategy.
"""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from ...options import Budget, Fraction, TreeSize
from ..decode import DecodeState
from ..drafters import SuffixDrafter
from ..effects import Calls
from ..proposal import Proposal
from .base import Strategy

Small = Annotated[int, Field(ge=1, le=64)]


class SuffixSpeculative(Strategy):
    name = "suffix"

    def __init__(self, budget: Budget = "auto", max_budget: TreeSize = 24, width: Small = 4,
                 min_prob: Fraction = 0.05, depth: Annotated[int, Field(ge=2, le=64)] = 24, max_match: Small = 16,
                 scope: Annotated[str, Field(max_length=128)] = "default", prompts: bool = False,
                 global_nodes: Annotated[int, Field(ge=1000, le=50_000_000)] = 500_000):
        self.budget, self.max_budget, self.scope = budget, max_budget, scope
        self.drafter = SuffixDrafter(scope, width, min_prob, depth, max_match, prompts, global_nodes)
        self.drafters = [self.drafter]
        self.sized(budget, max_budget)

    def propose(self, st: DecodeState) -> Calls:
        return self.free(st)
        yield                                     # noqa: unreachable: a coroutine with no model call

    def free(self, st: DecodeState) -> Proposal:
        """Every step, drafting or not by the ar gate: the tree costs no model call."""
        return self.drafter.alone(st, self.nodes)
