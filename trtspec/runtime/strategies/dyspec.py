"""dyspec: DySpec dynamic token trees (Xiong et al.), both variants.

Children of a node are drawn from the draft WITHOUT replacement: each draw comes from the residual R
(the draft distribution with earlier siblings removed, renormalised), and R is stored as that
child's q so Sequoia/DySpec recursive rejection verifies exactly. Under greedy target decoding the
"draw" is the residual's argmax (draft temperature 0): greedy verification is exact for any tree.

- heap (Algorithm 1): a max-heap of slots. A node's child slot is worth v·R[y] (its path
  probability), the next-sibling slot at the same parent v·(1 − R[y]). Pop the best slots until the
  node budget is spent. Draft forwards are lazy and batched: a popped child slot whose node is not
  fed yet is fed together with the other such slots of the round (`batch` pops per round).
- threshold (Algorithm 2): layer by layer, one batched draft forward per layer; at every leaf keep
  drawing children while the slot value v > t (the paper prints `v < t`, a typo), capped by budget.

With `budget: auto` (the default; cap `max_budget`) the budget (budget/auto.py) also vets every drawn
child (its calibrated acceptance must pay for its verify cost, else drafting ends) and every draft
forward; a step where no tree pays is a plain ar step.
"""
from __future__ import annotations

import heapq
from typing import Annotated, Literal

import torch
from pydantic import Field

from ...options import MAX_STEP_TOKENS, Budget, Depth, Fraction, TreeSize
from ..budget import Round, joined
from ..decode import DecodeState
from ..draft_tree import DraftTree
from ..runner import Calls
from .base import Strategy


class DySpec(Strategy):
    name = "dyspec"
    needs_draft = True

    def __init__(self, variant: Literal["heap", "threshold"] = "heap", budget: Budget = "auto",
                 max_budget: TreeSize = 32, batch: Annotated[int, Field(ge=1, le=MAX_STEP_TOKENS - 1)] = 6,
                 threshold: Fraction = 0.05, max_depth: Depth = 12):
        self.variant, self.budget, self.max_budget, self.batch = variant, budget, max_budget, batch
        self.threshold, self.max_depth = threshold, max_depth
        self.sized(budget, max_budget)

    def max_draft_rows(self) -> int:
        return self.nodes                      # every fed node was added first

    def _child(self, st: DecodeState, tree: DraftTree, parent: int, residual: torch.Tensor, value: dict):
        """Draw one child from `residual`; returns (node, R[y], residual without y), or None when the
        budget finds the child not worth verifying. `value`: the nodes' values, in the order they
        joined the tree."""
        greedy = st.sampling.greedy
        ahead = self.max_depth - int(tree.depth[parent]) - 1     # draft forwards still possible below it
        if greedy:                  # the draw is the argmax, valued by its own draft probability: one read
            y = residual.argmax()
            y, ry, qy = torch.stack([y.to(residual.dtype), residual[y], tree.probs[parent][y]]).tolist()
            y = int(y)                                  # token ids < 2^24: exact in float32
            v = st.values.child(value[parent], qy)
            if not self._pays(st, tree, value, v, ahead):
                return None
        else:                       # decided before the draw (Values.drawn), then drawn
            v = st.values.drawn(value[parent], residual, tree.probs[parent])
            if not self._pays(st, tree, value, v, ahead):
                return None
            y = int(torch.multinomial(residual, 1, generator=st.gen))
            ry = float(residual[y])
        node = tree.add(parent, y, q=None if greedy else residual.clone())
        value[node] = v
        rest = residual.clone()
        rest[y] = 0.0
        total = float(rest.sum())
        return node, ry, (rest / total if total > 0 else None)

    @staticmethod
    def _pays(st: DecodeState, tree: DraftTree, value: dict, v: float, ahead: int) -> bool:
        """Does a child of value v join the tree (the budget's plan for it alone, with the chain of up
        to `ahead` more draft forwards it would open)?"""
        return st.budget.plan(Round(joined(value), tree.forward_rows, [v], width=1, ahead=ahead)).take > 0

    def propose(self, st: DecodeState) -> Calls:
        tree = yield from DraftTree.open(st, capacity=self.nodes + 2)
        st.values.saw_top1(tree.top[0][0][0])
        value = {0: 1.0}                        # each node's value, in the order it joined (the root first)
        if self.variant == "heap":
            yield from self._heap(st, tree, value)
        else:
            yield from self._threshold(st, tree, value)
        return tree.proposal(values=joined(value))

    def _heap(self, st: DecodeState, tree: DraftTree, value: dict) -> Calls:
        # slot = (-value, tiebreak, parent, residual or None if the parent still needs feeding)
        budget = st.budget
        heap = [(-1.0, 0, 0, tree.probs[0])]
        count, added = 1, 0
        while heap and added < self.nodes:
            slots = [heapq.heappop(heap) for _ in range(min(self.batch, len(heap), self.nodes - added))]
            unfed = [parent for _, _, parent, res in slots if res is None]
            if unfed:
                fed_slots = [value[parent] * st.values.top1 for _, _, parent, res in slots if res is not None]
                r = Round(joined(value), tree.forward_rows, fed_slots, [value[n] for n in unfed], len(unfed),
                          ahead=self.max_depth - min(int(tree.depth[n]) for n in unfed))
                if budget.plan(r).feed:
                    yield from tree.feed(unfed)
                    for n in unfed:
                        st.values.saw_top1(tree.top[n][0][0])
                else:                                   # budget auto: their children are not worth a forward
                    slots = [sl for sl in slots if sl[3] is not None]
            for neg, _, parent, res in slots:
                v = -neg
                if res is None:
                    res = tree.probs[parent]
                drawn = self._child(st, tree, parent, res, value)
                if drawn is None:                       # budget auto: this slot's child does not pay
                    continue
                node, ry, rest = drawn
                added += 1
                if rest is not None:                    # next sibling at the same parent
                    heapq.heappush(heap, (-(v * (1 - ry)), count, parent, rest))
                    count += 1
                if tree.depth[node] < self.max_depth:   # first child of the new node: fed lazily
                    heapq.heappush(heap, (-(v * ry), count, node, None))
                    count += 1

    def _threshold(self, st: DecodeState, tree: DraftTree, value: dict) -> Calls:
        leaves = [(0, 1.0)]
        added = 0
        for depth in range(self.max_depth):
            if depth > 0:
                r = Round(joined(value), tree.forward_rows, feed=[value[n] for n, _ in leaves], rows=len(leaves),
                          ahead=self.max_depth - depth)
                if not st.budget.plan(r).feed:
                    return
                yield from tree.feed([n for n, _ in leaves])   # one batched forward per layer
            new = []
            for node, v in leaves:
                res = tree.probs[node]
                while v > self.threshold and added < self.nodes and res is not None:
                    drawn = self._child(st, tree, node, res, value)
                    if drawn is None:
                        break
                    child, ry, res = drawn
                    new.append((child, v * ry))
                    v *= 1 - ry
                    added += 1
            leaves = [(n, v) for n, v in new if v > self.threshold]   # only these can grow children
            if not leaves or added >= self.nodes:
                break
