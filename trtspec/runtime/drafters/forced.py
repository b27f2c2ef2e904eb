"""Forced (`grammar`): the tokens a request's grammar forces, as a drafter (jump-forward).

Where a request's grammar (grammar.py) allows exactly one token after a node (llguidance forces one
tokenization of what a grammar fixes: keys, brackets, separators), that token has probability 1
under the constrained target: the walk accepts it whenever it reaches the node, and the step emits
it without a target forward of its own. A request without a grammar gets nothing from it.

- `grow(st, proposal, masks, most)`: what the shared step adds to every request's tree under a
  grammar, whatever its strategy (step.py): under each node of the final tree (whose masks the
  grammar has just computed) its forced token, and again after that one, up to `most` tokens in all
  (the target's largest step bounds them). A stop token is added (it ends the output), never extended.
- `chain(st, context, n)`: the forced continuation of `context`, for a strategy that lists it
  (`drafter: grammar+ngram`: staged's stage 2 reviews the forced chain where there is one).
- `candidates(st, cap)`: the forced chain from the root, each node certain given its parent (score
  1, calibrated under its own tag like any scored drafter's).

Deterministic: verified with q = one-hot, lossless whatever it proposes.
"""
from __future__ import annotations

import numpy as np

from ..decode import DecodeState
from ..proposal import Proposal
from .base import Candidate, Drafter

JUMP = 16          # forced tokens a step may add to its tree


class Forced(Drafter):
    name = "grammar"
    scored = True

    def chain(self, st: DecodeState, context: np.ndarray, n: int) -> list[int]:
        """The tokens the grammar forces after `context` (the sequence, then a path after it), up to `n`."""
        g = st.grammar
        if g is None or len(context) < st.n_tokens:
            return []
        return g.forced_after([int(t) for t in context[st.n_tokens:]], n)

    def candidates(self, st: DecodeState, cap: int) -> tuple[int, list[Candidate]]:
        """(0, the forced chain from the root, up to `cap`): each the child of the one before it."""
        out: list[Candidate] = []
        value = 1.0
        for tok in self.chain(st, st.tokens(), cap):
            value = st.values.child(value, 1.0, self.tag)
            out.append(Candidate(len(out) - 1, tok, 1.0, value))
        return 0, out

    def grow(self, st: DecodeState, proposal: Proposal, masks: np.ndarray,
             most: int = JUMP) -> tuple[Proposal, np.ndarray]:
        """The proposal with the forced tokens under its nodes (`masks`: each node's mask row, as
        GrammarState.fit gave them), and their masks after the nodes'; up to min(`most`, JUMP)."""
        g, tree = st.grammar, proposal.tree
        n = len(tree)
        parents, tokens, rows = [], [], []
        have = {(int(p), int(t)) for p, t in zip(tree.host_parents[1:], tree.host_tokens[1:])}
        paths: dict[int, list[int]] = {}
        todo = [i for i in range(n) if int(tree.host_tokens[i]) not in g.stop_ids or i == 0]
        while todo and len(tokens) < min(most, JUMP):
            node = todo.pop(0)
            tok = g.only(masks[node] if node < n else rows[node - n])
            if tok is None or (node, tok) in have or tok >= g.vocab_size:
                continue
            path = paths[node] if node >= n else tree.host_tokens[tree.path(node)[1:]].tolist()
            child = n + len(tokens)
            parents.append(node)
            tokens.append(tok)
            paths[child] = path + [tok]
            row = None if tok in g.stop_ids else g.mask_after(paths[child])
            if row is not None:
                todo.append(child)
            rows.append(np.full(g.words, -1, dtype=np.int32) if row is None else row)
        if not tokens:
            return proposal, masks
        return proposal.extend(parents, tokens, self.tag), np.concatenate([masks, np.array(rows, dtype=np.int32)])
