"""staged: Spector & Ré's staged speculative decoding.

Stage 1, the tree the target verifies: best-first by cumulative draft probability (the product of
draft probabilities along the path), so width lands near the root where it buys the most, under a
node budget. Each round adds the `width` best candidates and feeds them to the draft in ONE batched
forward (the draft runs only on internal nodes: the last round's leaves are never fed).
Stage 2, speeding up the draft itself: in the same forward, the n-gram drafter proposes a chain after
the round's best node and the draft reviews it (kept while it equals the draft's argmax), so one
draft forward can advance several levels. Children are deterministic (top tokens, n-gram copies),
so sampling verification uses the exact q = one-hot rule.
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

from ...options import Fraction, TreeSize
from .base import Strategy

Small = Annotated[int, Field(ge=1, le=64)]


class Staged(Strategy):
    name = "staged"
    needs_draft = True

    def __init__(self, budget: TreeSize = 24, width: Small = 6, top_k: Small = 4, max_rounds: Small = 8,
                 stage2: bool = True, stage2_len: Annotated[int, Field(ge=0, le=64)] = 6, min_prob: Fraction = 0.01):
        self.budget, self.width, self.top_k, self.max_rounds = budget, width, top_k, max_rounds
        self.stage2, self.stage2_len, self.min_prob = stage2, stage2_len, min_prob
        self.ngram = NGramDrafter()

    def max_tree_size(self) -> int:
        return self.budget + (self.max_rounds * self.stage2_len if self.stage2 else 0) + 1

    def max_draft_rows(self) -> int:
        return self.max_tree_size() - 1        # fed nodes + reviewed stage-2 tokens

    def _push(self, heap: list, tree: DraftTree, node: int, value: float) -> None:
        """Candidate children of a fed node, keyed by cumulative probability (max-heap via -value)."""
        p = tree.probs[node]
        top = p.topk(min(self.top_k, p.numel()))
        have = set(tree.tokens[tree.children(node)].tolist())
        for prob, tok in zip(top.values.tolist(), top.indices.tolist()):
            if tok not in have and value * prob >= self.min_prob:
                heapq.heappush(heap, (-value * prob, node, tok))

    def step(self, st: DecodeState) -> Calls:
        t0 = time.perf_counter()
        tree = yield from DraftTree.open(st, capacity=self.max_tree_size() + 1)
        value = {0: 1.0}
        heap: list = []
        self._push(heap, tree, 0, 1.0)
        added = 0
        for rnd in range(self.max_rounds):
            picks = []
            while heap and len(picks) < self.width and added + len(picks) < self.budget:
                neg, parent, tok = heapq.heappop(heap)
                if tok in tree.tokens[tree.children(parent)] or (parent, tok) in {(p, t) for p, t, _ in picks}:
                    continue                            # a stage-2 chain already put it there
                picks.append((parent, tok, -neg))
            if not picks:
                break
            new = []
            for parent, tok, v in picks:
                node = tree.add(parent, tok)
                value[node] = v
                new.append(node)
            added += len(new)
            if added >= self.budget or rnd == self.max_rounds - 1:
                break                                   # leaves: never fed
            chains = {}
            if self.stage2:                             # n-gram chain after the most likely new node
                best = new[0]
                proposal = self.ngram.propose(tree.context(best), self.stage2_len)
                if proposal:
                    chains[best] = proposal
            for node in (yield from tree.feed(new, chains)):
                if node not in value:                   # a reviewed stage-2 token
                    parent = int(tree.parents[node])
                    value[node] = value[parent] * float(tree.probs[parent][int(tree.tokens[node])])
                self._push(heap, tree, node, value[node])
        st.draft_seconds = time.perf_counter() - t0
        return (yield from tree.finish(stage2_proposed=tree.reviewed, stage2_accepted=tree.review_kept))[0]
