"""ModelRunner: one request's view of one model: its KV slot, and every model call it makes.

Every model call of every strategy goes through `run`: prefill chunks, draft extensions and tree
verification differ only in the mask and positions they pass. The committed prefix is always fully
visible; the caller describes visibility over the scratch rows plus the new tokens.

The calls are coroutines: `logits = yield from runner.run(...)` yields a `Call` and receives its
logits, so the scheduler can run many requests' calls as one batched engine step (batch.py). What
else a coroutine waits on (a host read, a verification, a head's answer) is in effects.py, with the
one resolver that answers them; `effects.drive(coro)` runs a coroutine alone (tools and tests).
"""
from __future__ import annotations

import torch

from ..options import MAX_STEP_TOKENS, PREFILL_CHUNK
from .batch import Batcher, Call
from .effects import Calls
from .hooks import Hooks
from .kv_cache import KVCache
from .tree import TokenTree


class ModelRunner:
    def __init__(self, batcher: Batcher, cache: KVCache, vocab: int | None = None):
        self.batcher = batcher
        self.engine = batcher.engine
        self.cache = cache
        self._iota = torch.arange(MAX_STEP_TOKENS, dtype=torch.int64)   # logit-row indices, reused
        # A draft whose embedding table is smaller or larger than the target's (Qwen2.5-0.5B has
        # 151,936 rows, Qwen2.5-7B 152,064) answers in the target's vocabulary: logits are cut to
        # `vocab` or padded with -inf, so q and p always have one shape and no draft token is an id
        # the target lacks. A target token the draft has no row for is fed to it as its last row:
        # the draft guesses worse after it, the output is unaffected (q is still the distribution
        # each proposal was drawn from).
        rows = self.engine.spec.vocab_size
        self.vocab = None if vocab in (None, rows) else vocab
        self.max_id = rows - 1 if self.vocab is not None and self.vocab > rows else None

    @classmethod
    def alone(cls, engine, capacity: int, buckets: dict | None = None, hooks: Hooks | None = None) -> "ModelRunner":
        """A runner with a one-slot pool of its own (tools and tests that drive one sequence)."""
        batcher = Batcher(engine, buckets, max_batch=1, capacity=capacity, hooks=hooks)
        return cls(batcher, engine.new_pool(1, capacity + batcher.headroom).caches[0])

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor,
            logit_rows: torch.Tensor | None = None, phase: str = "step", hidden: bool = False) -> Calls:
        """tokens/positions [T]; new_mask [T, scratch+T] bool. Returns logits for `logit_rows` (default:
        all); with `hidden`, (logits, the rows its LM head read: None with an engine without them).
        The runner keeps neither: what a request keeps of them is its DecodeState's (`hidden`)."""
        if self.max_id is not None:
            tokens = tokens.clamp(max=self.max_id)
        call = Call(self.batcher, self.cache, tokens, positions, new_mask, logit_rows, phase)
        logits = self._fit_vocab((yield call).float())     # where the engine left them: no host copy
        return (logits, call.hidden) if hidden else logits

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return logits
        if logits.shape[-1] > self.vocab:
            return logits[:, : self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))

    def extend(self, tokens: list[int], last_only: bool = True, phase: str = "step", hidden: bool = False) -> Calls:
        """Append a causal chunk after everything in the cache (committed + scratch, e.g. a chain);
        `hidden`: as `run`."""
        t = len(tokens)
        c = self.cache
        ids = torch.tensor(tokens, dtype=torch.int64)
        pos = torch.arange(c.used, c.used + t, dtype=torch.int64)
        new_mask = torch.ones(t, c.scratch + t, dtype=torch.bool)
        new_mask[:, c.scratch:] = torch.ones(t, t, dtype=torch.bool).tril_()
        rows = self._iota[t - 1:t] if last_only else None
        return (yield from self.run(ids, pos, new_mask, rows, phase, hidden))

    def prefill(self, tokens: list[int], chunk: int = PREFILL_CHUNK) -> Calls:
        """Commit `tokens` in chunks that end at multiples of `chunk` in the sequence: a row is computed
        by the same call whatever came before it in the cache (a stored prefix, or a cold prefill), so
        prefix caching is exact by construction (prefix_cache.py). Returns the last row's hidden row
        (with an engine that has them; else, or with nothing to prefill, None)."""
        i, rows = 0, None
        while i < len(tokens):
            part = tokens[i:i + chunk - self.cache.length % chunk]
            _, rows = yield from self.extend(part, last_only=True, phase="prefill", hidden=True)
            self.cache.commit(range(len(part)))
            i += len(part)
        return rows

    def verify(self, tree: TokenTree, hidden: bool = False) -> Calls:
        """One forward over a whole tree placed after the committed prefix; logits for every node
        (`hidden`: as `run`)."""
        c = self.cache
        assert c.scratch == 0, "verify expects no uncommitted rows"
        tree = tree.to(self.engine.device)
        return (yield from self.run(tree.tokens, c.length + tree.depth, tree.ancestors, hidden=hidden))

    def reset(self) -> None:
        self.cache.reset()
