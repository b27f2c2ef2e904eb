"""gsd: Graph-structured speculative decoding (Gong et al.), lossless.

Drafting, one batched draft forward per depth: every frontier node proposes its top-k tokens; a
candidate survives if p ≥ sibling_ratio · p_top1. A surviving candidate that repeats an existing
node (same token and the same r preceding tokens, `repeat` = r) is MERGED: the parent gets an edge
to that node instead of a new node, so the draft never runs on it — that is the saving. A merge that
would make a cycle, or point at the parent's own ancestor, is refused (the reference code checks
neither). Drafting stops when a depth adds no confident node (p ≥ confidence along the whole path).

Verification: the DAG is unrolled into a tree (BFS over real and merged edges, duplicating merged
subtrees, up to the node budget) because a node's KV depends on its prefix. Children are
deterministic, so sampling verification uses the exact q = one-hot rule (not the reference code's
biased min(1, p/q) acceptance). Draft KV fix-up: nodes reached through a merged edge are `borrowed`;
the draft commit stops there and those accepted tokens are re-fed as pending next step.

With `budget: auto` (the default; cap `max_budget`) the budget (budget/auto.py) vets each depth's draft
forward and each node of the unrolled tree (a node whose calibrated acceptance does not pay for its
verify cost is left out, with its subtree); a step where no tree pays is a plain ar step.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Annotated

import numpy as np
from pydantic import Field

from ...options import Budget, Fraction, TreeSize
from ..budget import Round
from ..decode import DecodeState
from ..draft_model import DraftModel
from ..effects import Calls
from .base import Strategy

if TYPE_CHECKING:
    from ..draft_model import DraftTree


class GSD(Strategy):
    name = "gsd"
    needs_draft = True

    def __init__(self, top_k: Annotated[int, Field(ge=1, le=64)] = 3, sibling_ratio: Fraction = 0.2,
                 confidence: Fraction = 0.3, repeat: Annotated[int, Field(ge=-1, le=32)] = 1,
                 max_depth: Annotated[int, Field(ge=1, le=64)] = 8, budget: Budget = "auto",
                 max_budget: TreeSize = 32, max_draft_nodes: TreeSize = 64):
        self.top_k, self.sibling_ratio, self.confidence, self.repeat = top_k, sibling_ratio, confidence, repeat
        self.max_depth, self.budget, self.max_budget = max_depth, budget, max_budget
        self.max_draft_nodes = max_draft_nodes
        self.sized(budget, max_budget)
        self.model = DraftModel()                 # the draft model alone

    def max_draft_rows(self) -> int:
        # Fed frontier nodes: those at depths 1 .. max_depth-1, at most top_k**d of them at depth d.
        rows, level = 0, 1
        for _ in range(1, self.max_depth):
            level *= self.top_k
            rows += level
            if rows >= self.max_draft_nodes:
                break
        return min(rows, self.max_draft_nodes)

    def _match(self, tree: DraftTree, parent: int, tok: int, merged: dict[int, list[int]]) -> int:
        """An existing node with token `tok` whose r preceding tokens equal parent's path; -1 if none."""
        if self.repeat < 0:
            return -1
        n = tree.size
        cand = np.flatnonzero((tree.tokens[:n] == tok) & tree.alive[:n])
        cand = cand[~tree.anc[parent, cand]]                       # never an ancestor-or-self of parent
        for m in cand.tolist():
            a, b, ok = parent, int(tree.parents[m]), True
            for _ in range(self.repeat):
                if a < 0 or b < 0 or tree.tokens[a] != tree.tokens[b]:
                    ok = False
                    break
                a, b = int(tree.parents[a]), int(tree.parents[b])
            if ok and not self._reaches(tree, m, parent, merged):  # the edge parent->m must not close a cycle
                return m
        return -1

    @staticmethod
    def _reaches(tree: DraftTree, src: int, dst: int, merged: dict[int, list[int]]) -> bool:
        stack, seen = [src], set()
        while stack:
            u = stack.pop()
            if u == dst:
                return True
            if u in seen:
                continue
            seen.add(u)
            stack += tree.children(u).tolist() + merged.get(u, [])
        return False

    def propose(self, st: DecodeState) -> Calls:
        budget = st.budget
        tree = yield from self.model.open(st, capacity=self.max_draft_nodes + self.nodes + 2, top_k=self.top_k)
        path_p = {0: 1.0}                       # each node's value: its (calibrated) path probability
        merged: dict[int, list[int]] = {}       # DAG edges that are not tree edges: parent -> [node]
        confident = {0: True}
        frontier, merges = [0], 0
        for depth in range(self.max_depth):
            if depth > 0:
                # its nodes join the tree at the end (_unroll): all of them are known candidates
                r = Round([v for n, v in path_p.items() if n], [path_p[n] for n in frontier],
                          len(frontier), ahead=self.max_depth - depth)
                if not budget.plan(r).feed:
                    break
                yield from tree.feed(frontier)
            new = []
            for node in frontier:
                kids = tree.candidates(node, path_p[node])      # read with the forward that fed it
                for v, tok, prob in kids:
                    if prob < self.sibling_ratio * kids[0][2] or tree.size >= self.max_draft_nodes:
                        continue
                    m = self._match(tree, node, tok, merged)
                    if m >= 0:
                        merged.setdefault(node, []).append(m)
                        merges += 1
                        continue
                    child = tree.add(node, tok)
                    path_p[child] = v
                    confident[child] = confident[node] and prob >= self.confidence
                    new.append(child)
            if not any(confident[c] for c in new):
                break
            frontier = new
        keep, joined = self._unroll(st, tree, merged)
        st.ledger.joined(joined)
        return tree.proposal(keep, path_flags={"merged_path": "borrowed"}, merges=merges)

    def _unroll(self, st: DecodeState, tree: DraftTree, merged: dict[int, list[int]]) -> tuple[list[int], list[float]]:
        """BFS over real + merged edges; a node reached via a merged edge is copied (with its subtree,
        as the BFS reaches it) as a `borrowed` node, so the target sees a tree of distinct prefixes.
        The tree is the best-value prefix the budget takes (all of it when fixed): a child's value
        never exceeds its parent's, so the prefix keeps every kept node's parent. Returns the kept
        nodes and their values (the root's left out)."""
        dag = {g: tree.children(g).tolist() for g in range(tree.size)}   # before copies are added
        plan = [(-1, 0, 1.0)]                    # (parent entry, DAG node, value) in BFS order
        queue = deque([0])
        while queue and len(plan) <= self.nodes:
            i = queue.popleft()
            g, v = plan[i][1], plan[i][2]
            for c in dag[g] + merged.get(g, []):
                if len(plan) > self.nodes:
                    break
                cv = st.values.child(v, tree.prob(g, int(tree.tokens[c])))
                plan.append((i, c, cv))
                queue.append(len(plan) - 1)
        # best value first, stable: a parent (earlier in BFS) before an equal child; then back in BFS order
        chosen = sorted(range(1, len(plan)), key=lambda j: -plan[j][2])
        take = st.budget.plan(Round([plan[j][2] for j in chosen])).take
        chosen = sorted(chosen[:take])
        node_of, keep, joined = {0: 0}, [0], []
        for j in chosen:
            i, c, cv = plan[j]
            g, t = plan[i][1], node_of[i]
            node_of[j] = c if t == g and c in dag[g] else tree.add(t, int(tree.tokens[c]), borrowed=True)
            keep.append(node_of[j])
            joined.append(cv)
        return keep, joined
