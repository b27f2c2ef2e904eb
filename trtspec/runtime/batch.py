"""Calls and the Batcher: many requests' model calls as one engine step.

Every model call of every strategy is a `Call`: one request's new tokens, their positions, their
visibility over the request's own scratch rows and each other (`new_mask`), and the rows that need
logits. Strategies yield calls (see runner.py); the scheduler collects the calls waiting on one
model and hands them to that model's `Batcher`, which runs them as one `Engine.step_batch`:

- T (new tokens) is padded to the largest in the batch (then to a token bucket), C (the past) to
  the longest row's cache (then to a cache bucket; without buckets, B > 1 rows to a multiple of
  STAGING_ROWS, see kv_cache.BatchStaging), R (logit rows) to the largest.
- Row b sees its committed prefix, the scratch rows its mask allows, and its own new tokens; pad
  tokens see only themselves; columns past a row's own cache are stale rows (of its slot or of
  its staged copy), masked.
  Rows never see each other: a neighbour in the batch cannot change a request's logits.
- The engine writes every row's T (padded) new rows at its cache's `used`; the Batcher then
  advances each cache by its own call's tokens only, so the pad rows are written and dropped. Each
  slot is allocated with `headroom` rows beyond its capacity for them. A step that raises leaves
  every cache as it was (`KVCache.restore`).

One call alone with no bucket to pad to runs at its exact shape. Calls larger than `max_batch_tokens`
run alone (a prefill chunk padded into a batch of one-token steps would multiply their cost).
The input buffers are preallocated for the largest batch and reused by every step.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ..options import MAX_STEP_TOKENS
from .engine import Engine
from .hooks import NONE, Hooks
from .kv_cache import KVCache

MAX_BATCH_TOKENS = 64     # calls with more new tokens than this run alone
# B > 1 rows are copied into one contiguous block per step (kv_cache.BatchStaging); their past is
# padded up to a multiple of this, so the block keeps its layout and only changed rows are recopied.
STAGING_ROWS = 64
# One lock per engine object: engines own step state (IO bindings, staging, logits buffers), so two
# Generators (two scheduler threads) over the same engine must take turns.
_ENGINE_LOCKS: "weakref.WeakKeyDictionary[Engine, threading.Lock]" = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def engine_lock(engine: Engine) -> threading.Lock:
    with _LOCKS_LOCK:
        return _ENGINE_LOCKS.setdefault(engine, threading.Lock())


def bucket(n: int, sizes: list[int] | None) -> int:
    """Smallest bucket >= n (n itself when bucketing is off or n is beyond the largest bucket)."""
    if not sizes:
        return n
    return next((b for b in sizes if b >= n), n)


@dataclass
class Call:
    """One request's model call, waiting to be run (possibly with other requests' calls)."""
    batcher: "Batcher"
    cache: KVCache
    tokens: torch.Tensor        # [T] int64
    positions: torch.Tensor     # [T] int64
    new_mask: torch.Tensor      # [T, scratch + T] bool: visibility over the scratch rows, then the new ones
    rows: torch.Tensor | None   # [R] logit rows (None: all T)
    phase: str = "step"         # "prefill" or "step" (only for timing)
    hidden: torch.Tensor | None = None   # after the run, with an engine's hidden rows: [R, hidden_size]

    @property
    def t(self) -> int:
        return self.tokens.shape[0]

    @property
    def r(self) -> int:
        return self.t if self.rows is None else self.rows.shape[0]


class Batcher:
    """Runs calls on one engine, alone or batched; owns the (reused) batch input buffers."""

    def __init__(self, engine: Engine, buckets: dict[str, list[int]] | None = None, max_batch: int = 8,
                 capacity: int = 2048, max_batch_tokens: int = MAX_BATCH_TOKENS, hooks: Hooks | None = None):
        self.engine = engine
        self.hooks = hooks or NONE                  # told of each forward (hooks.py)
        self.lock = engine_lock(engine)
        self.token_buckets = sorted((buckets or {}).get("tokens") or [])
        self.cache_buckets = sorted((buckets or {}).get("cache") or [])
        # An engine built for at most N rows per step (a TensorRT plan's profile) caps the batch.
        self.max_batch = min(max_batch, getattr(engine, "max_batch", max_batch))
        # An engine whose exactness needs one shape per token bucket (a GPU target: the LM head's
        # GEMM takes another kernel for one row than for sixteen) gets every padded call's logit
        # rows padded to the bucket too, a one-row call included.
        self.fixed_rows = getattr(engine, "fixed_rows", False)
        # Such an engine is exact only at its shape: a step takes at most its largest token bucket.
        self.max_step = max(self.token_buckets) if self.fixed_rows and self.token_buckets else MAX_STEP_TOKENS
        self.max_batch_tokens = max_batch_tokens
        self.forwards = 0
        self.rows = 0                               # batch rows over all forwards (mean batch size)
        # Forward timing, for bench: seconds and engine steps per phase (a batch of only prefill
        # calls is "prefill"). With `timed` on a GPU each step syncs the device, so it is off by default.
        self.timed = False
        self.seconds = {"prefill": 0.0, "step": 0.0}
        self.steps = {"prefill": 0, "step": 0}
        t_max = max(MAX_STEP_TOKENS, max(self.token_buckets, default=0))
        self.headroom = max(max_batch_tokens, max(self.token_buckets, default=0))
        width = bucket(capacity + self.headroom, self.cache_buckets) + STAGING_ROWS + t_max
        cells = max(max_batch * bucket(max_batch_tokens, self.token_buckets), t_max)
        dev = engine.device
        self._mask = torch.zeros(cells * width, dtype=torch.bool, device=dev)
        self._ids = torch.zeros(cells, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(cells, dtype=torch.int64, device=dev)
        self._rows = torch.zeros(cells, dtype=torch.int64, device=dev)
        self._iota = torch.arange(t_max, dtype=torch.int64, device=dev)

    def groups(self, calls: list[Call]) -> list[list[Call]]:
        """How `calls` are run: small calls together (up to max_batch a step), large ones alone."""
        small = [c for c in calls if c.t <= self.max_batch_tokens]
        out = [[c] for c in calls if c.t > self.max_batch_tokens]
        out += [small[i:i + self.max_batch] for i in range(0, len(small), self.max_batch)]
        return out

    @torch.inference_mode()
    def run(self, calls: list[Call]) -> list[torch.Tensor]:
        """One engine step over `calls` (rows in order); logits [R_b, V] for each call (copied out of
        an engine-owned buffer, so they outlive the next step)."""
        marks = [c.cache.mark() for c in calls]
        try:
            with self.lock:
                return self._run(calls)
        except BaseException:
            for call, mark in zip(calls, marks):
                call.cache.restore(mark)
            raise

    def _run(self, calls: list[Call]) -> list[torch.Tensor]:
        self.forwards += 1
        self.rows += len(calls)
        caches = [c.cache for c in calls]
        ids, pos, mask, rows = self._inputs(calls, *self._shape(calls))
        self.hooks.forward(self, True)
        t0 = time.perf_counter()
        try:
            if self.timed:
                logits = self._timed_step("prefill" if all(c.phase == "prefill" for c in calls) else "step",
                                          caches, ids, pos, mask, rows)
            else:
                logits = self.engine.step_batch(caches, ids, pos, mask, rows)
        finally:
            self.hooks.forward(self, False, time.perf_counter() - t0)
        out = []
        hidden = self.engine.hidden if self.engine.hidden_rows else None
        own = self.engine.logits_in_own_buffer      # (its hidden rows too): copied out before the next step
        for i, call in enumerate(calls):
            call.cache.advance(call.t)              # the real rows; the pad rows after them are dropped
            x = logits[i, : call.r]
            out.append(x.clone() if own else x)
            if hidden is not None:
                call.hidden = hidden[i, : call.r].clone() if own else hidden[i, : call.r]
        return out

    def _shape(self, calls: list[Call]) -> tuple[int, int, int, bool]:
        """(T, C, R, exact): new tokens, past and logit rows of the step, padded; exact when it runs one
        call at its own shape."""
        b = len(calls)
        t_real = max(c.t for c in calls)
        t = bucket(t_real, self.token_buckets)
        c_real = max(c.cache.used for c in calls)
        if self.cache_buckets:
            past = bucket(c_real, self.cache_buckets)
        elif b > 1:                                 # staged rows: a layout that lasts many steps
            past = -(-c_real // STAGING_ROWS) * STAGING_ROWS
        else:
            past = c_real
        r = max(c.r for c in calls)
        if t > t_real and (r > 1 or self.fixed_rows):
            r = t                                   # logit rows are static per token bucket
        return t, past, r, b == 1 and t == t_real and past == c_real

    def _inputs(self, calls: list[Call], t: int, past: int, r: int, exact: bool):
        """The step's (ids, positions, mask, logit rows), written into the reused buffers."""
        b = len(calls)
        ids = self._ids[: b * t].view(b, t)
        pos = self._pos[: b * t].view(b, t)
        rows = self._rows[: b * r].view(b, r)
        mask = self._mask[: b * t * (past + t)].view(b, t, past + t)
        if exact:
            call, cache = calls[0], calls[0].cache
            mask[0, :, : cache.length] = True
            mask[0, :, cache.length:] = call.new_mask
            ids[0].copy_(call.tokens)
            pos[0].copy_(call.positions)
            rows[0].copy_(call.rows if call.rows is not None else self._iota[:t])
            return ids, pos, mask, rows
        mask.zero_()
        ids.zero_()
        rows.zero_()
        for i, call in enumerate(calls):
            cache, n = call.cache, call.t
            mask[i, :n, : cache.length] = True
            mask[i, :n, cache.length: cache.used] = call.new_mask[:, : cache.scratch]
            mask[i, :n, past: past + n] = call.new_mask[:, cache.scratch:]
            pad = self._iota[n:t]
            mask[i, pad, past + pad] = True         # pad tokens see only themselves
            ids[i, :n] = call.tokens
            pos[i, :n] = call.positions
            pos[i, n:] = call.positions[-1]
            rows[i, : call.r] = call.rows if call.rows is not None else self._iota[:n]
        return ids, pos, mask, rows

    def _timed_step(self, phase: str, *args) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = self.engine.step_batch(*args)
        if str(self.engine.device).startswith("cuda"):
            torch.cuda.synchronize()
        self.seconds[phase] += time.perf_counter() - t0
        self.steps[phase] += 1
        return logits

    def reset_timing(self) -> None:
        self.seconds = {"prefill": 0.0, "step": 0.0}
        self.steps = {"prefill": 0, "step": 0}
