"""suffix: SuffixDecoding (Oliaro et al.): a token tree from suffix tries, with no model call.

The request's own trie (its prompt and output so far) and, unless `scope` is empty, the global trie
of that scope (finished requests' outputs, and prompts with `prompts: true`; bounded by
`global_nodes`, oldest forgotten first; ~270 bytes a node, so the default 500k is ~135 MB) are matched against the longest suffix of the sequence
that they hold with a continuation (at most `max_match` tokens), and the tree grows best-first from
there: a node's score is the product of its path's empirical probabilities (pooled counts), up to
`width` children per node, `min_prob` at least, and never deeper than the tries remember. Children
are deterministic (q = one-hot under sampling): lossless like every strategy.

With `budget: auto` (the default; cap `max_budget`) the budget values each node by its calibrated
score (acceptance is learned per request, as for a draft model's probabilities) and stops where a
node no longer pays for its verify cost; with a number it is the node budget.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Annotated

import numpy as np
from pydantic import Field

from ...options import Budget, Fraction, TreeSize
from ..decode import DecodeState
from ..proposal import Proposal
from ..runner import Calls
from ..suffix import Suffixes, continuations, match, store
from ..tree import TokenTree
from .base import Strategy

Small = Annotated[int, Field(ge=1, le=64)]


class SuffixSpeculative(Strategy):
    name = "suffix"

    def __init__(self, budget: Budget = "auto", max_budget: TreeSize = 24, width: Small = 4,
                 min_prob: Fraction = 0.05, depth: Annotated[int, Field(ge=2, le=64)] = 24, max_match: Small = 16,
                 scope: Annotated[str, Field(max_length=128)] = "default", prompts: bool = False,
                 global_nodes: Annotated[int, Field(ge=1000, le=50_000_000)] = 500_000):
        self.budget, self.max_budget, self.width, self.min_prob = budget, max_budget, width, min_prob
        self.depth, self.max_match, self.scope, self.prompts = depth, min(max_match, depth - 1), scope, prompts
        self.global_nodes = global_nodes
        self.sized(budget, max_budget)

    def _store(self, st: DecodeState):
        """The global trie of this scope for this target's vocabulary (histories of models with another
        vocabulary are never proposed to it), or None when the global trie is off."""
        if not self.scope:
            return None
        return store(self.scope, self.depth, st.target.engine.spec.vocab_size, self.global_nodes)

    def propose(self, st: DecodeState) -> Calls:
        own = st.strategy_state.setdefault(self.name, Suffixes(self.depth))
        own.sync(st.tokens())
        shared = self._store(st)
        if shared is None:
            return self._grow(st, [own.tree])
        with shared.lock:                         # other requests may add to it meanwhile
            return self._grow(st, [own.tree, shared.tree])
        yield                                     # noqa: unreachable: a coroutine with no model call

    def _grow(self, st: DecodeState, trees) -> Proposal:
        budget = st.budget
        matched, nodes = match(trees, st.tokens(), self.max_match)
        tokens, parents, probs = [st.root], [-1], [np.nan]
        heap: list = []
        order = itertools.count()                 # ties: the earlier candidate first
        room = self.depth - matched               # the tries remember windows of `depth` tokens

        def push(parent: int, value: float, under, depth: int) -> None:
            if depth > room:
                return
            for tok, p, kids in continuations(under)[: self.width]:
                v = budget.value(value, p)
                if v >= self.min_prob:
                    heapq.heappush(heap, (-v, next(order), parent, tok, p, kids, depth))

        if nodes:
            push(0, 1.0, nodes, 1)
        while heap and len(tokens) - 1 < self.nodes:
            neg, _, parent, tok, p, kids, depth = heapq.heappop(heap)
            if not budget.worth(-neg):
                break
            budget.add(-neg)
            tokens.append(tok)
            parents.append(parent)
            probs.append(p)
            push(len(tokens) - 1, -neg, kids, depth + 1)
        node_q = np.array(probs)
        return Proposal(TokenTree(tokens, parents), node_q=lambda: node_q, stats={"suffix_match": matched})

    def finished(self, st: DecodeState, prompt: list[int], output: list[int]) -> None:
        shared = self._store(st)
        if shared is not None and output:
            shared.add((prompt if self.prompts else []) + output)
