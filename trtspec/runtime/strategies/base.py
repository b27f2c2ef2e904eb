"""Strategy: the one-method interface every decoding strategy implements.

A strategy's `step(state)` drafts however it likes, ends with `state.verify_and_commit(tree)` (the
shared exact target step), commits its draft KV if it has a draft model, and returns the emitted
tokens. Strategies share TokenTree / DraftTree / verification / KV machinery; none re-implements it.
"""
from __future__ import annotations

from ..decode import DecodeState


class Strategy:
    name = "base"
    needs_draft = False

    def step(self, st: DecodeState) -> list[int]:
        raise NotImplementedError

    def max_tree_size(self) -> int:
        """Largest tree one step can send to the target (for capacity checks)."""
        return 1
