"""staged: Spector & Ré's staged speculative decoding.

Stage 1, the tree the target verifies: best-first by cumulative draft probability (the product of
draft probabilities along the path), so width lands near the root where it buys the most, under a
node budget. Each round adds the `width` best candidates and feeds them to the draft in ONE batched
forward (the draft runs only on internal nodes: the last round's leaves are never fed).
Stage 2, speeding up the draft itself: in the same forward, the n-gram drafter proposes a chain after
the round's best node and the draft reviews it (kept while it equals the draft's argmax), so one
draft forward can advance several levels. Children are deterministic (top tokens, n-gram copies),
so sampling verification uses the exact q = one-hot rule.
With `budget: auto` (the default) the budget (budget/auto.py) decides each round how many of the best
candidates pay for their verify cost and whether another draft forward pays, up to `max_budget`
nodes; a step where no tree pays is a plain ar step.
"""
from __future__ import annotations

import heapq
from typing import Annotated

from pydantic import Field

from ...options import Budget, Fraction, TreeSize
from ..decode import DecodeState
from ..draft_tree import DraftTree
from ..ngram import NGramDrafter
from ..runner import Calls
from .base import Strategy

Small = Annotated[int, Field(ge=1, le=64)]


class Staged(Strategy):
    name = "staged"
    needs_draft = True

    def __init__(self, budget: Budget = "auto", max_budget: TreeSize = 32, width: Small = 6, top_k: Small = 4,
                 max_rounds: Small = 8, stage2: bool = True, stage2_len: Annotated[int, Field(ge=0, le=64)] = 6,
                 min_prob: Fraction = 0.01):
        self.budget, self.max_budget, self.width, self.top_k = budget, max_budget, width, top_k
        self.max_rounds = max_rounds
        self.stage2, self.stage2_len, self.min_prob = stage2, stage2_len, min_prob
        self.sized(budget, max_budget)
        self.ngram = NGramDrafter()

    def max_tree_size(self) -> int:
        return self.nodes + (self.max_rounds * self.stage2_len if self.stage2 else 0) + 1

    def max_draft_rows(self) -> int:
        return self.max_tree_size() - 1        # fed nodes + reviewed stage-2 tokens

    def _push(self, heap: list, tree: DraftTree, node: int, value: float, budget) -> None:
        """Candidate children of a fed node, keyed by value (max-heap via -value): the cumulative
        draft probability, or with budget auto the calibrated probability of acceptance."""
        probs, toks = tree.top[node]               # read with the forward that fed it
        have = set(tree.tokens[tree.children(node)].tolist())
        budget.saw_top1(probs[0])
        for prob, tok in zip(probs, toks):
            v = budget.value(value, prob)
            if tok not in have and v >= self.min_prob:
                heapq.heappush(heap, (-v, node, tok))

    def propose(self, st: DecodeState) -> Calls:
        budget = st.budget
        tree = yield from DraftTree.open(st, capacity=self.max_tree_size() + 1, top_k=self.top_k)
        value = {0: 1.0}
        heap: list = []
        self._push(heap, tree, 0, 1.0, budget)
        added = 0
        for rnd in range(self.max_rounds):
            ahead = self.max_rounds - rnd - 1
            room = min(self.width, budget.take(sorted(-c[0] for c in heap)[::-1], self.width, ahead))
            picks = self._pick(heap, tree, min(room, self.nodes - added), budget)
            if not picks:
                break
            new = [tree.add(parent, tok) for parent, tok, _ in picks]
            value.update(zip(new, (v for _, _, v in picks)))
            added += len(new)
            if added >= self.nodes or rnd == self.max_rounds - 1:
                break                                   # leaves: never fed
            chains = self._stage2(tree, new[0])
            fed_rows = len(new) + sum(len(c) for c in chains.values())
            if not budget.worth_feeding([-c[0] for c in heapq.nsmallest(self.width, heap)],
                                        [value[n] for n in new], fed_rows, ahead):
                break
            budget.draft_forward(fed_rows)
            for node in (yield from tree.feed(new, chains)):
                if node in value or self._keep_reviewed(tree, node, value, budget):
                    self._push(heap, tree, node, value[node], budget)
        return tree.proposal(stage2_proposed=tree.reviewed, stage2_accepted=tree.review_kept)

    @staticmethod
    def _pick(heap: list, tree: DraftTree, room: int, budget) -> list[tuple[int, int, float]]:
        """The `room` best candidates (parent, token, value) off the heap, skipping tokens a stage-2
        chain already put under their parent."""
        picks: list[tuple[int, int, float]] = []
        while heap and len(picks) < room:
            neg, parent, tok = heapq.heappop(heap)
            if tok in tree.tokens[tree.children(parent)] or any(p == parent and t == tok for p, t, _ in picks):
                continue
            budget.add(-neg)
            picks.append((parent, tok, -neg))
        return picks

    def _stage2(self, tree: DraftTree, best: int) -> dict[int, list[int]]:
        """Stage 2: the n-gram drafter's chain after the round's most likely new node, for the draft
        to review in the same forward."""
        proposal = self.ngram.propose(tree.context(best), self.stage2_len) if self.stage2 else []
        return {best: proposal} if proposal else {}

    @staticmethod
    def _keep_reviewed(tree: DraftTree, node: int, value: dict, budget) -> bool:
        """A stage-2 token the draft's review kept: in the tree if it is worth verifying (else it and
        its subtree are cut). Nodes under a cut token are not alive."""
        if not tree.alive[node]:
            return False
        parent = int(tree.parents[node])
        v = budget.value(value[parent], tree.prob(parent, int(tree.tokens[node])))
        if not budget.worth(v):
            tree.cut(node)
            return False
        budget.add(v)
        value[node] = v
        return True
