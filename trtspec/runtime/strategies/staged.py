"""staged: Spector & Ré's staged speculative decoding.

Stage 1, the tree the target verifies: best-first by cumulative draft probability (the product of
draft probabilities along the path), so width lands near the root where it buys the most, under a
node budget. Each round adds the `width` best candidates and feeds them to the draft in ONE batched
forward (the draft runs only on internal nodes: the last round's leaves are never fed).
Stage 2, speeding up the draft itself: in the same forward, the n-gram drafter proposes a chain after
the round's best node and the draft reviews it (kept while it equals the draft's argmax), so one
draft forward can advance several levels. Children are deterministic (top tokens, n-gram copies),
so sampling verification uses the exact q = one-hot rule.
With `budget: auto` (the default) the policy (adaptive.py) decides each round how many of the best
candidates pay for their verify cost and whether another draft forward pays, up to `max_budget`
nodes; a step where no tree pays is a plain ar step.
"""
from __future__ import annotations

import heapq
import time

from ..decode import DecodeState
from ..runner import Calls
from ..draft_tree import DraftTree
from ..ngram import NGramDrafter
from typing import Annotated

from pydantic import Field

from ...options import Budget, Fraction, TreeSize
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
        self.nodes = max_budget if budget == "auto" else budget
        self.ngram = NGramDrafter()

    def auto_nodes(self) -> int | None:
        return self.nodes if self.budget == "auto" else None

    def max_tree_size(self) -> int:
        return self.nodes + (self.max_rounds * self.stage2_len if self.stage2 else 0) + 1

    def max_draft_rows(self) -> int:
        return self.max_tree_size() - 1        # fed nodes + reviewed stage-2 tokens

    def _push(self, heap: list, tree: DraftTree, node: int, value: float, pol) -> None:
        """Candidate children of a fed node, keyed by value (max-heap via -value): the cumulative
        draft probability, or with budget auto the calibrated probability of acceptance."""
        probs, toks = tree.top[node]               # read with the forward that fed it
        have = set(tree.tokens[tree.children(node)].tolist())
        if pol is not None:
            pol.saw_top1(probs[0])
        for prob, tok in zip(probs, toks):
            v = pol.value(value, prob) if pol is not None else value * prob
            if tok not in have and v >= self.min_prob:
                heapq.heappush(heap, (-v, node, tok))

    def step(self, st: DecodeState) -> Calls:
        pol = st.policy
        if not st.will_draft():
            return (yield from st.ar_step())
        t0 = time.perf_counter()
        tree = yield from DraftTree.open(st, capacity=self.max_tree_size() + 1, top_k=self.top_k)
        if pol is not None:
            pol.opened(len(tree.pending))
        value = {0: 1.0}
        heap: list = []
        self._push(heap, tree, 0, 1.0, pol)
        added = 0
        for rnd in range(self.max_rounds):
            picks = []
            room = self.width if pol is None else \
                min(self.width, pol.take(sorted(-c[0] for c in heap)[::-1], self.width, self.max_rounds - rnd - 1))
            while heap and len(picks) < room and added + len(picks) < self.nodes:
                neg, parent, tok = heapq.heappop(heap)
                if tok in tree.tokens[tree.children(parent)] or (parent, tok) in {(p, t) for p, t, _ in picks}:
                    continue                            # a stage-2 chain already put it there
                if pol is not None:
                    pol.add(-neg)
                picks.append((parent, tok, -neg))
            if not picks:
                break
            new = []
            for parent, tok, v in picks:
                node = tree.add(parent, tok)
                value[node] = v
                new.append(node)
            added += len(new)
            if added >= self.nodes or rnd == self.max_rounds - 1:
                break                                   # leaves: never fed
            chains = {}
            if self.stage2:                             # n-gram chain after the most likely new node
                best = new[0]
                proposal = self.ngram.propose(tree.context(best), self.stage2_len)
                if proposal:
                    chains[best] = proposal
            fed_rows = len(new) + sum(len(c) for c in chains.values())
            if pol is not None:
                if not pol.worth_feeding([-c[0] for c in heapq.nsmallest(self.width, heap)],
                                         [value[n] for n in new], fed_rows, self.max_rounds - rnd - 1):
                    break
                pol.draft_forward(fed_rows)
            for node in (yield from tree.feed(new, chains)):
                if not tree.alive[node]:                # under a stage-2 token cut below
                    continue
                if node not in value:                   # a reviewed stage-2 token
                    parent = int(tree.parents[node])
                    prob = tree.prob(parent, int(tree.tokens[node]))
                    if pol is not None:
                        v = pol.value(value[parent], prob)
                        if not pol.worth(v):            # kept by the review, but not worth verifying
                            tree.alive[node:tree.size] &= ~tree.anc[node:tree.size, node]
                            continue
                        pol.add(v)
                        value[node] = v
                    else:
                        value[node] = value[parent] * prob
                self._push(heap, tree, node, value[node], pol)
        st.draft_seconds = time.perf_counter() - t0
        return (yield from tree.finish(stage2_proposed=tree.reviewed, stage2_accepted=tree.review_kept))[0]
