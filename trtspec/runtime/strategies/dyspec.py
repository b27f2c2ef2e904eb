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

With `budget: auto` (the default; cap `max_budget`) the budget (budget/auto.py) is asked once per
round (a heap round's `batch` pops, a threshold layer): whether its draft forward pays, and the bar
a child drawn in it must pass (its calibrated acceptance must pay for its verify cost, with the
draft forwards it may still open below it). A child under the bar is not added (for a sampled
child: decided before it is drawn, by its expected value); a step where no tree pays is a plain ar
step.
"""
from __future__ import annotations

import heapq
from typing import TYPE_CHECKING, Annotated, Literal

import torch
from pydantic import Field

from ...options import MAX_STEP_TOKENS, Budget, Depth, Fraction, TreeSize
from ..budget import Plan, Round
from ..decode import DecodeState
from ..draft_model import DraftModel
from ..effects import Calls, read
from ..sampling import inverse_cdf, keyed_on
from .base import Strategy

if TYPE_CHECKING:
    from ..draft_model import DraftTree


class DySpec(Strategy):
    name = "dyspec"
    needs_draft = True

    def __init__(self, variant: Literal["heap", "threshold"] = "heap", budget: Budget = "auto",
                 max_budget: TreeSize = 32, batch: Annotated[int, Field(ge=1, le=MAX_STEP_TOKENS - 1)] = 6,
                 threshold: Fraction = 0.05, max_depth: Depth = 12):
        self.variant, self.budget, self.max_budget, self.batch = variant, budget, max_budget, batch
        self.threshold, self.max_depth = threshold, max_depth
        self.sized(budget, max_budget)
        self.model = DraftModel()                 # the draft model alone

    def max_draft_rows(self) -> int:
        return self.nodes                      # every fed node was added first

    def _children(self, st: DecodeState, tree: DraftTree, slots: list, value: dict, plan: Plan) -> Calls:
        """One child per slot (parent, residual), drawn from its residual (greedy: the argmax), joining
        the tree where the round's `plan` lets its value in. Returns, per slot, (node, R[y], residual
        without y) or None. The slots have distinct parents, so their draws are apart: one read for
        the round (sampled: two, as a child's value is known before it is drawn; each draw uses its
        position's keyed uniform). `value`: the nodes' values, in the order they joined."""
        greedy, values = st.sampling.greedy, st.values
        if not slots:
            return []
        if greedy:                  # the draw is the argmax, valued by its own draft probability
            join, ys = [True] * len(slots), [res.argmax() for _, res in slots]
        else:                       # decided before the draw (Values.drawn), then drawn
            e = [1.0] * len(slots) if not values.calibrated else \
                (yield from read(torch.stack([values.expected(res, tree.probs[p]) for p, res in slots])))
            vs = [value[p] * x for (p, _), x in zip(slots, e)]
            join = [plan.joins(v, self._ahead(tree, p)) for v, (p, _) in zip(vs, slots)]
            # each with the keyed uniform of the position it would take (verify.drawn): the target's
            # draw there is the same inverse CDF, so a child agrees with it as often as they can
            u = keyed_on(slots[0][1].device, st.seed, [st.n_tokens + int(tree.depth[p]) for p, _ in slots])
            ys = [inverse_cdf(res[None], u[i:i + 1])[0] if j else None for i, (j, (_, res)) in enumerate(zip(join, slots))]
        # per drawn slot: the token (ids < 2^24), R[y], q[y] and the mass left once y is removed
        facts = [torch.stack([y.to(res.dtype), res[y], tree.probs[p][y], res.sum() - res[y]])
                 for j, y, (p, res) in zip(join, ys, slots) if j]
        host = iter((yield from read(torch.stack(facts))) if facts else ())
        out = []
        for i, (j, (p, res)) in enumerate(zip(join, slots)):
            y, ry, qy, total = (next(host), next(host), next(host), next(host)) if j else (0, 0, 0, 0)
            v = values.child(value[p], qy) if greedy else vs[i]
            if not j or not plan.joins(v, self._ahead(tree, p)):
                out.append(None)
                continue
            node = tree.add(p, int(y), q=None if greedy else res.clone())
            value[node] = v
            rest = None
            if total > 0:                       # (0 exactly when y held all the mass: a one-hot residual)
                rest = res.clone()
                rest[int(y)] = 0.0
                rest /= total
            out.append((node, ry, rest))
        return out

    def _ahead(self, tree: DraftTree, parent: int) -> int:
        """Draft forwards still possible below a child of `parent` (the bar's look-ahead for it)."""
        return self.max_depth - int(tree.depth[parent]) - 1

    def propose(self, st: DecodeState) -> Calls:
        tree = yield from self.model.open(st, capacity=self.nodes + 2)
        st.values.saw_top1(tree.top[0][0][0])
        value = st.ledger.value                 # each node's value, in the order it joined (the root first)
        if self.variant == "heap":
            yield from self._heap(st, tree, value)
        else:
            yield from self._threshold(st, tree, value)
        return tree.proposal()

    def _heap(self, st: DecodeState, tree: DraftTree, value: dict) -> Calls:
        # slot = (-value, tiebreak, parent, residual or None if the parent still needs feeding)
        budget = st.budget
        heap = [(-1.0, 0, 0, tree.probs[0])]
        count, added = 1, 0
        while heap and added < self.nodes:
            slots = [heapq.heappop(heap) for _ in range(min(self.batch, len(heap), self.nodes - added))]
            unfed = [parent for _, _, parent, res in slots if res is None]
            fed_slots = [value[parent] * st.values.top1 for _, _, parent, res in slots if res is not None]
            plan = budget.plan(Round(fed_slots if unfed else (),
                                     [value[n] for n in unfed], len(unfed),
                                     ahead=self.max_depth - min((int(tree.depth[n]) for n in unfed), default=0),
                                     bar_ahead=max(self._ahead(tree, sl[2]) for sl in slots)))
            if plan.feed:
                yield from tree.feed(unfed)
                for n in unfed:
                    st.values.saw_top1(tree.top[n][0][0])
            elif unfed:                                 # budget auto: their children are not worth a forward
                slots = [sl for sl in slots if sl[3] is not None]
            draws = [(parent, tree.probs[parent] if res is None else res) for _, _, parent, res in slots]
            for (neg, _, parent, _), drawn in zip(slots, (yield from self._children(st, tree, draws, value, plan))):
                v = -neg
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
            plan = st.budget.plan(Round(feed=[value[n] for n, _ in leaves],
                                        rows=len(leaves) if depth else 0, ahead=self.max_depth - depth,
                                        bar_ahead=self.max_depth - depth - 1))
            if depth > 0:
                if not plan.feed:
                    return
                yield from tree.feed([n for n, _ in leaves])   # one batched forward per layer
            new = []
            for node, v in leaves:
                res = tree.probs[node]
                while v > self.threshold and added < self.nodes and res is not None:
                    drawn = (yield from self._children(st, tree, [(node, res)], value, plan))[0]
                    if drawn is None:
                        break
                    child, ry, res = drawn
                    new.append((child, v * ry))
                    v *= 1 - ry
                    added += 1
            leaves = [(n, v) for n, v in new if v > self.threshold]   # only these can grow children
            if not leaves or added >= self.nodes:
                break
