"""DraftModel (`draft`): the draft model as a drafter, one whose candidates cost a forward of its role.

Every strategy that runs a draft model (`needs_draft`: chain, staged, dyspec, gsd, cascade) holds it
first in its list of drafters, before the free ones a config names (`Strategy.drafters`), and
reaches the model through it alone, as it reaches the others through theirs:

- `open(st, capacity, top_k)`: a step's tree grown by the draft (DraftTree, draft_tree.py: the
  draft catches up on the tokens it has not seen and runs on the root; then `tree.candidates(node,
  value)` are its valued children of a fed node, `tree.feed(nodes, chains)` feeds a frontier and
  reviews the free drafters' chains in the same forward, and `tree.proposal()` hands the tree and
  its draft KV rows to the shared step, which commits the accepted path's);
- `extend(st, tokens)` and `catch_up(st)`: a chain's forwards, one token at a time (`chain`);
- `forwards(st)`: the request's draft forwards so far (a step reports how many it made).

Its nodes are tagged `draft` (proposal.DRAFT). Nothing of it is free: `chain` and `candidates`, the
free drafters' interface, are empty, so `first_chain` and `offers` pass over it. Per-request state
(the draft's KV, its scratch rows) lives in the request's slot and DecodeState, never here.
"""
from __future__ import annotations

import numpy as np

from ..decode import DecodeState
from ..draft_tree import DraftTree
from ..effects import Calls
from .base import Drafter


class DraftModel(Drafter):
    name = "draft"
    role = "draft"

    def open(self, st: DecodeState, capacity: int = 512, top_k: int = 1) -> Calls:
        """A step's tree rooted at the last emitted token (a coroutine: `tree = yield from model.open(st)`)."""
        return (yield from DraftTree.open(st, capacity, top_k))

    def catch_up(self, st: DecodeState) -> Calls:
        """Prefill what the draft lacks beyond its usual lag (after ar steps), as DraftTree.open does."""
        yield from st.draft_catch_up()

    def extend(self, st: DecodeState, tokens: list[int]) -> Calls:
        """The draft's logits after `tokens`, appended to its scratch (one forward)."""
        return (yield from st.draft.extend(tokens))

    def forwards(self, st: DecodeState) -> int:
        """The request's draft forwards so far."""
        return st.draft.forwards

    def chain(self, st: DecodeState, context: np.ndarray, n: int) -> list[int]:
        return []
