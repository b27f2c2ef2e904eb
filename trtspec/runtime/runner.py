"""ModelRunner: one engine + its KV cache + preallocated step inputs. The only caller of engine.step.

Every model call of every strategy goes through `run`: prefill chunks, draft extensions and tree
verification differ only in the mask and positions they pass. The committed prefix is always fully
visible; the caller describes visibility over the scratch rows plus the new tokens.
"""
from __future__ import annotations

import torch

from ..engines.base import Engine
from .tree import TokenTree


class ModelRunner:
    def __init__(self, engine: Engine, capacity: int, max_step_tokens: int = 256):
        self.engine = engine
        self.cache = engine.new_cache(capacity)
        self.max_step_tokens = max_step_tokens
        # Flat buffers viewed as [T, used+T] each step: contiguous, allocated once.
        self._mask = torch.empty(max_step_tokens * capacity, dtype=torch.bool)
        self._pos = torch.empty(max_step_tokens, dtype=torch.int64)
        self._rows = torch.arange(max_step_tokens, dtype=torch.int64)
        self.forwards = 0

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor,
            logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens/positions [T]; new_mask [T, scratch+T] bool. Returns logits for `logit_rows` (default: all)."""
        t = tokens.shape[0]
        c = self.cache
        total = c.used + t
        mask = self._mask[: t * total].view(t, total)
        mask[:, : c.length] = True
        mask[:, c.length:] = new_mask
        rows = self._rows[:t] if logit_rows is None else logit_rows
        self.forwards += 1
        return self.engine.step(c, tokens, positions, mask, rows)

    def extend(self, tokens: list[int], last_only: bool = True) -> torch.Tensor:
        """Append a causal chunk after everything in the cache (committed + scratch, e.g. a chain)."""
        t = len(tokens)
        c = self.cache
        ids = torch.tensor(tokens, dtype=torch.int64)
        pos = torch.arange(c.used, c.used + t, dtype=torch.int64)
        new_mask = torch.ones(t, c.scratch + t, dtype=torch.bool)
        new_mask[:, c.scratch:] = torch.ones(t, t, dtype=torch.bool).tril_()
        rows = self._rows[t - 1:t] if last_only else None
        return self.run(ids, pos, new_mask, rows)

    def prefill(self, tokens: list[int]) -> None:
        """Commit `tokens` in chunks of at most max_step_tokens."""
        for i in range(0, len(tokens), self.max_step_tokens):
            chunk = tokens[i:i + self.max_step_tokens]
            self.extend(chunk, last_only=True)
            self.cache.commit(range(len(chunk)))

    def verify(self, tree: TokenTree) -> torch.Tensor:
        """One forward over a whole tree placed after the committed prefix; logits for every node."""
        c = self.cache
        assert c.scratch == 0, "verify expects no uncommitted rows"
        return self.run(tree.tokens, c.length + tree.depth, tree.ancestors)

    def reset(self) -> None:
        self.cache.reset()
        self.forwards = 0
