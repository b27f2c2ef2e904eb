"""ModelRunner: one engine + its KV cache + preallocated step inputs. The only caller of engine.step.

Every model call of every strategy goes through `run`: prefill chunks, draft extensions and tree
verification differ only in the mask and positions they pass. The committed prefix is always fully
visible; the caller describes visibility over the scratch rows plus the new tokens.
"""
from __future__ import annotations

import torch

from ..engines.base import Engine
from ..options import MAX_STEP_TOKENS
from .tree import TokenTree


def bucket(n: int, sizes: list[int] | None) -> int:
    """Smallest bucket >= n (n itself when bucketing is off or n is beyond the largest bucket)."""
    if not sizes:
        return n
    return next((b for b in sizes if b >= n), n)


class ModelRunner:
    def __init__(self, engine: Engine, capacity: int, max_step_tokens: int = MAX_STEP_TOKENS,
                 buckets: dict[str, list[int]] | None = None, vocab: int | None = None):
        self.engine = engine
        self.max_step_tokens = max_step_tokens
        # A draft whose embedding table is smaller or larger than the target's (Qwen2.5-0.5B has
        # 151,936 rows, Qwen2.5-7B 152,064) answers in the target's vocabulary: logits are cut to
        # `vocab` or padded with -inf, so q and p always have one shape and no draft token is an id
        # the target lacks. A target token the draft has no row for is fed to it as its last row:
        # the draft guesses worse after it, the output is unaffected (q is still the distribution
        # each proposal was drawn from).
        rows = engine.spec.vocab_size
        self.vocab = None if vocab in (None, rows) else vocab
        self.max_id = rows - 1 if self.vocab is not None and self.vocab > rows else None
        # Static-shape buckets: T (new tokens) and C (cache length) are padded up to these sizes,
        # so every step reuses a few shapes (CUDA graphs, TensorRT profiles). Padding is masked.
        self.token_buckets = sorted((buckets or {}).get("tokens") or [])
        self.cache_buckets = sorted((buckets or {}).get("cache") or [])
        headroom = max(self.token_buckets, default=0)
        self.cache = engine.new_cache(capacity + headroom)    # padded rows may spill past capacity
        self.capacity = capacity
        width = bucket(capacity, self.cache_buckets) + max(max_step_tokens, headroom)
        # Flat buffers viewed as [T, C+T] each step: contiguous, allocated once.
        self._mask = torch.empty(max(max_step_tokens, headroom) * width, dtype=torch.bool)
        self._rows = torch.arange(max(max_step_tokens, headroom), dtype=torch.int64)
        self.forwards = 0

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor,
            logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens/positions [T]; new_mask [T, scratch+T] bool. Returns logits for `logit_rows` (default: all)."""
        t = tokens.shape[0]
        c = self.cache
        rows = self._rows[:t] if logit_rows is None else logit_rows
        if self.max_id is not None:
            tokens = tokens.clamp(max=self.max_id)
        self.forwards += 1
        tb = bucket(t, self.token_buckets)
        past = bucket(c.used, self.cache_buckets) if self.cache_buckets else c.used
        if tb == t and past == c.used:
            total = c.used + t
            mask = self._mask[: t * total].view(t, total)
            mask[:, : c.length] = True
            mask[:, c.length:] = new_mask
            return self._fit_vocab(self.engine.step(c, tokens, positions, mask, rows))
        return self._fit_vocab(self._run_padded(tokens, positions, new_mask, rows, tb, past))

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return logits
        if logits.shape[-1] > self.vocab:
            return logits[:, : self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))

    def _run_padded(self, tokens, positions, new_mask, rows, tb: int, past: int) -> torch.Tensor:
        """Pad T to tb and the past to `past` rows. Pad tokens see only themselves; stale cache rows
        in [used, past) are seen by nobody; the pad rows' KV is written and then rolled back."""
        t, c = tokens.shape[0], self.cache
        total = past + tb
        mask = self._mask[: tb * total].view(tb, total)
        mask.zero_()
        mask[:t, : c.length] = True
        mask[:t, c.length: c.used] = new_mask[:, : c.scratch]
        mask[:t, past: past + t] = new_mask[:, c.scratch:]
        pad = torch.arange(t, tb)
        mask[pad, past + pad] = True
        ids = torch.zeros(tb, dtype=torch.int64)
        ids[:t] = tokens
        pos = torch.empty(tb, dtype=torch.int64)
        pos[:t] = positions
        pos[t:] = positions[-1]
        logits = self.engine.step(c, ids, pos, mask, rows)
        c.scratch -= tb - t                    # keep only the real rows
        return logits

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
