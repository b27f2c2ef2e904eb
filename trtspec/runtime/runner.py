"""ModelRunner: one request's view of one model: its KV slot, and every model call it makes.

Every model call of every strategy goes through `run`: prefill chunks, draft extensions and tree
verification differ only in the mask and positions they pass. The committed prefix is always fully
visible; the caller describes visibility over the scratch rows plus the new tokens.

The calls are coroutines: `logits = yield from runner.run(...)` yields a `Call` and receives its
logits, so the scheduler can run many requests' calls as one batched engine step (batch.py).
A value the host needs from the device is fetched the same way: `host = yield from read(tensor)`
yields a `Read`, and the scheduler reads every request's waiting Reads of a phase in one transfer
(`read_together`: one device sync for the batch, not one per request). A step's verification
(`verify.check`) waits the same way, as a `Check`: the phase's Checks are chosen together
(`verify.choose_together`) and read with its Reads. `drive(coro)` runs a coroutine alone, each
call as its own step and each read alone (tools and tests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generator as Coroutine

import torch

from ..options import MAX_STEP_TOKENS, PREFILL_CHUNK
from . import verify
from .batch import Batcher, Call
from .heads import HeadCall, run_heads
from .kv_cache import KVCache
from .tree import TokenTree
from .verify import Check


@dataclass
class Read:
    """A device tensor one request needs on the host (`read`), waiting to be read with its batch's."""
    tensor: torch.Tensor
    batcher = None                                  # not a model call


Calls = Coroutine["Call | Read | Check | HeadCall", "torch.Tensor | list", object]   # a coroutine of model calls
HOST = (Read, Check, HeadCall)                     # what a coroutine waits on that is not a step with KV


def read(tensor: torch.Tensor) -> Calls:
    """`host = yield from read(t)`: t's values as a flat Python list, read with the batch's other
    reads (`read_together`). Integer values come back as ints (exact below 2^53)."""
    return (yield Read(tensor))


def read_together(reads: list[Read | Check | HeadCall]) -> list[list]:
    """Every Read's values, every Check's choice (chosen together: verify.choose_together) and every
    HeadCall's answer (one forward per head: heads.run_heads), with one host transfer: flattened,
    joined as float64 where they are (one device sync), split back, integer tensors' values as ints."""
    checks = [r for r in reads if isinstance(r, Check)]
    chosen = iter(verify.choose_together(checks) if checks else ())   # (looked up here: tools wrap it)
    heads = [r for r in reads if isinstance(r, HeadCall)]
    answered = iter(run_heads(heads) if heads else ())
    flat = [(next(chosen) if isinstance(r, Check) else next(answered) if isinstance(r, HeadCall) else r.tensor
             ).reshape(-1) for r in reads]
    host = torch.cat([x.to(torch.float64) for x in flat]).tolist() if flat else []
    out, i = [], 0
    for x in flat:
        part = host[i:i + x.numel()]
        out.append([int(v) for v in part] if not x.dtype.is_floating_point else part)
        i += x.numel()
    return out


def drive(coro: Calls):
    """Run a coroutine of model calls to its end, each call (and each read) alone; returns its value."""
    try:
        call = next(coro)
        while True:
            call = coro.send(read_together([call])[0] if isinstance(call, HOST) else call.batcher.run([call])[0])
    except StopIteration as done:
        return done.value


class ModelRunner:
    def __init__(self, batcher: Batcher, cache: KVCache, vocab: int | None = None):
        self.batcher = batcher
        self.engine = batcher.engine
        self.cache = cache
        self.forwards = 0
        self.hidden: torch.Tensor | None = None   # the last call's hidden rows [R, hidden] (engines with them)
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
    def alone(cls, engine, capacity: int, buckets: dict | None = None) -> "ModelRunner":
        """A runner with a one-slot pool of its own (tools and tests that drive one sequence)."""
        batcher = Batcher(engine, buckets, max_batch=1, capacity=capacity)
        return cls(batcher, engine.new_pool(1, capacity + batcher.headroom).caches[0])

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, new_mask: torch.Tensor,
            logit_rows: torch.Tensor | None = None, phase: str = "step") -> Calls:
        """tokens/positions [T]; new_mask [T, scratch+T] bool. Returns logits for `logit_rows` (default: all)."""
        if self.max_id is not None:
            tokens = tokens.clamp(max=self.max_id)
        self.forwards += 1
        call = Call(self.batcher, self.cache, tokens, positions, new_mask, logit_rows, phase)
        logits = yield call
        self.hidden = call.hidden                   # the rows its LM head read, with an engine that has them
        return self._fit_vocab(logits.float())      # where the engine left them: no host copy

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab is None:
            return logits
        if logits.shape[-1] > self.vocab:
            return logits[:, : self.vocab]
        return torch.nn.functional.pad(logits, (0, self.vocab - logits.shape[-1]), value=float("-inf"))

    def extend(self, tokens: list[int], last_only: bool = True, phase: str = "step") -> Calls:
        """Append a causal chunk after everything in the cache (committed + scratch, e.g. a chain)."""
        t = len(tokens)
        c = self.cache
        ids = torch.tensor(tokens, dtype=torch.int64)
        pos = torch.arange(c.used, c.used + t, dtype=torch.int64)
        new_mask = torch.ones(t, c.scratch + t, dtype=torch.bool)
        new_mask[:, c.scratch:] = torch.ones(t, t, dtype=torch.bool).tril_()
        rows = self._iota[t - 1:t] if last_only else None
        return (yield from self.run(ids, pos, new_mask, rows, phase))

    def prefill(self, tokens: list[int], chunk: int = PREFILL_CHUNK) -> Calls:
        """Commit `tokens` in chunks that end at multiples of `chunk` in the sequence: a row is computed
        by the same call whatever came before it in the cache (a stored prefix, or a cold prefill), so
        prefix caching is exact by construction (prefix_cache.py)."""
        i = 0
        while i < len(tokens):
            part = tokens[i:i + chunk - self.cache.length % chunk]
            yield from self.extend(part, last_only=True, phase="prefill")
            self.cache.commit(range(len(part)))
            i += len(part)

    def verify(self, tree: TokenTree) -> Calls:
        """One forward over a whole tree placed after the committed prefix; logits for every node."""
        c = self.cache
        assert c.scratch == 0, "verify expects no uncommitted rows"
        tree = tree.to(self.engine.device)
        return (yield from self.run(tree.tokens, c.length + tree.depth, tree.ancestors))

    def reset(self) -> None:
        self.cache.reset()
        self.forwards = 0
        self.hidden = None
