"""KV ownership: one preallocated pool per model, a slot per request, written in place, committed by
compaction.

`KVPool.buf` is `[L, 2, slots, Hkv, S_max, D]`, allocated once. A request owns one slot while it
runs: `KVCache` is that slot's view `buf[:, :, slot]`, head-major, so `buf[l, j, slot, h, :C]` (the
past of layer l, KV head h) and `buf[l, j, slot, h, C:C+T]` (where the step's new rows go) are each
one contiguous block, which the step contract (v3) takes as one tensor per layer and head. A
one-row step binds both straight onto the pool (ONNX Runtime IO binding, torch views): the cache is
never copied or reallocated between steps. A step over B > 1 rows needs each head's past as one
[B, C, D] tensor, which slots of a pool are not: `BatchStaging` keeps a contiguous copy of each
row's past, updated incrementally, and copies the new rows back into the slots (sizes and costs in
docs/ARCHITECTURE.md). Inside a step, attention reads the past where it lies, as it lies
(export/model.py: no transposed copy of it).

Rows [0, length) are committed tokens. A step appends T rows after them as *scratch* (a token tree
being verified, or draft nodes being expanded). `commit(rows)` keeps the accepted scratch rows, in
order, right after the committed prefix (a no-op when they already are), and drops the rest.

This module is the only one that changes `length` and `scratch` (a test checks): engines write rows
where they are told and never move the bookkeeping; the Batcher advances a cache after a step (and
restores it when a step fails); the shared step (step.py) and prefill commit.
"""
from __future__ import annotations

import math
import mmap
import weakref

import numpy as np
import torch

from ..errors import TrtspecError
from ..export.spec import ModelSpec


class CapacityError(TrtspecError, RuntimeError):
    """The request does not fit the KV capacity (max_seq_len)."""


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed buffer. On the CPU it is fresh anonymous memory (mmap), whose pages the OS maps when
    they are first written: a pool's resident memory grows with the rows its slots have held, not
    with max_seq_len x slots (nothing reads a slot's rows past its own `used`)."""
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, n), dtype=dtype).view(shape)    # the tensor keeps the map


class KVPool:
    """All KV rows of one model: `buf[L, 2, slots, Hkv, S, D]`; `caches[i]` is slot i."""

    def __init__(self, spec: ModelSpec, slots: int, capacity: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        self.spec, self.capacity = spec, capacity
        self.buf = zeros((spec.num_layers, 2, slots, spec.num_kv_heads, capacity, spec.head_dim), dtype, device)
        self.caches = [KVCache(spec, capacity, self.buf[:, :, i], pool=self.buf, slot=i) for i in range(slots)]


class KVCache:
    """One slot of a KVPool: `buf[L, 2, Hkv, S, D]` (a view; each [l, j, h] block is contiguous)."""

    def __init__(self, spec: ModelSpec, capacity: int, buf: torch.Tensor, pool: torch.Tensor | None = None,
                 slot: int = 0):
        self.spec = spec
        self.capacity = capacity
        self.buf = buf
        # The whole pool's buffer and this slot's index in it: an engine that reads the pool in place
        # by slot (engines/logical_engine.py) finds the slot there. Fixed for the cache's life.
        self.pool, self.slot = (buf.unsqueeze(2) if pool is None else pool), slot
        # The [S, D] block of every (layer, key/value, head), in the step contract's order (views)
        self.blocks = [buf[l, j, h] for l in range(spec.num_layers) for j in (0, 1) for h in range(spec.num_kv_heads)]
        self.length = 0    # committed rows
        self.scratch = 0   # uncommitted rows written after them
        self.epoch = 0     # reset count: rows [0, length) change only when it does

    @property
    def used(self) -> int:
        return self.length + self.scratch

    def past(self, rows: int | None = None) -> list[torch.Tensor]:
        """Views [k0.h0, k0.h1, .., v0.h0, .., k1.h0, ...] of the first `rows` rows (default: every row
        written so far). More rows than `used` is a cache-length bucket: stale rows are masked out."""
        u = self.used if rows is None else rows
        return [blk[:u] for blk in self.blocks]

    def slots(self, t: int) -> list[torch.Tensor]:
        """Views of the next t rows, where a step writes its new keys/values."""
        u = self.used
        if u + t > self.capacity:
            raise CapacityError(
                f"the sequence needs {u + t} KV rows but the cache holds {self.capacity}; "
                "raise max_seq_len in the config (or shorten the prompt / max_new_tokens)")
        return [blk[u:u + t] for blk in self.blocks]

    def advance(self, t: int) -> None:
        """Count the t rows a step just wrote (at `used`) as scratch."""
        self.scratch += t

    def mark(self) -> tuple[int, int]:
        return self.length, self.scratch

    def restore(self, mark: tuple[int, int]) -> None:
        """Back to a `mark()` (a failed step: its rows are dropped, committed rows never moved)."""
        self.length, self.scratch = mark

    def rewind(self, length: int, scratch: int) -> None:
        """Back to `length` committed rows followed by the first `scratch` rows written after them,
        whatever was written since: `inspect --compare --trees` replays a tree's paths depth first
        over one long prefix (never during decoding)."""
        if not (0 <= length and 0 <= scratch and length + scratch <= self.capacity):
            raise ValueError(f"cannot rewind to {length} + {scratch} rows of a {self.capacity}-row cache")
        self.length, self.scratch = length, scratch

    def assume(self, rows: int) -> None:
        """Count the first `rows` rows as committed without writing them: timing runs, whose logits
        are never read (costs.measure_rows)."""
        self.reset()
        self.length = rows

    def load(self, parts: list[torch.Tensor]) -> None:
        """Commit rows computed elsewhere (`parts`: [L, 2, Hkv, n_i, D] each, in order: a stored prefix,
        another slot's prompt) as this empty cache's first rows."""
        assert self.length == 0 and self.scratch == 0, "load fills an empty cache"
        n = sum(p.shape[3] for p in parts)
        if n > self.capacity:
            raise CapacityError(f"{n} loaded rows exceed the cache's {self.capacity}")
        at = 0
        for p in parts:
            self.buf[:, :, :, at:at + p.shape[3]].copy_(p)
            at += p.shape[3]
        self.length = n

    def commit(self, rows) -> None:
        """Keep scratch rows `rows` (indices relative to `length`, ascending) as committed tokens."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        if n and not (rows[-1] == n - 1):  # rows ascending and unique: prefix iff last == n-1
            idx = torch.from_numpy(rows + self.length).to(self.buf.device)
            self.buf[:, :, :, self.length:self.length + n] = self.buf[:, :, :, idx]
        self.length += n
        self.scratch = 0

    def rollback(self) -> None:
        self.scratch = 0

    def reset(self) -> None:
        self.length = 0
        self.scratch = 0
        self.epoch += 1


class BatchStaging:
    """Contiguous copies for a step over B > 1 rows (one engine's, reused; it grows to the largest
    batch seen and never shrinks, so a steady state allocates nothing).

    `past(caches, c)` returns every row's past as `[2L*Hkv, B, c, D]`: rows [0, used) of row b are
    its slot's, the rest are stale (finite) and masked by the caller. The copy is incremental: a
    row's committed rows never change until its slot is reset, so while the layout (B, c) and the
    row's cache stay the same, only the rows from its last staged `length` on (rows committed since,
    and scratch rows) are copied again. The Batcher rounds a batch's past up to a multiple of
    `STAGING_ROWS`, so one layout lasts many steps. `new(b, t)` is where a step writes its
    `[2L*Hkv, B, t, D]` new keys/values; `scatter(caches, new)` copies row b's into its slot at
    `caches[b].used`. `copied_rows` counts the past rows copied (tests, benchmarks)."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: str | torch.device):
        self.spec, self.dtype, self.device = spec, dtype, device
        self._past = torch.empty(0, dtype=dtype, device=device)
        self._new = torch.empty(0, dtype=dtype, device=device)
        self._layout: tuple = ()
        self._staged: list[tuple] = []      # per row: (weakref to its cache, cache epoch, rows valid)
        self.copied_rows = 0

    def _view(self, name: str, b: int, rows: int) -> torch.Tensor:
        s = self.spec
        shape = (2 * s.num_layers * s.num_kv_heads, b, rows, s.head_dim)
        n = int(np.prod(shape))
        buf = getattr(self, name)
        if buf.numel() < n:
            # zeros, not empty: a row's stale columns are masked, but garbage could hold NaNs
            buf = torch.zeros(n, dtype=self.dtype, device=self.device)
            setattr(self, name, buf)
        return buf[:n].view(shape)

    def past(self, caches: list[KVCache], c: int) -> torch.Tensor:
        out = self._view("_past", len(caches), c)
        layout = (out.data_ptr(), len(caches), c)
        staged = self._staged if layout == self._layout else []
        starts = [0] * len(caches)
        for b, (cache, (ref, epoch, valid)) in enumerate(zip(caches, staged)):
            if ref() is cache and epoch == cache.epoch and cache.length >= valid:
                starts[b] = valid            # rows [0, valid) are still this cache's committed rows
        spans = [(start, min(cache.used, c)) for start, cache in zip(starts, caches)]
        self.copied_rows += gather_past(caches, out, spans)
        self._layout = layout
        self._staged = [(weakref.ref(cache), cache.epoch, min(cache.length, c)) for cache in caches]
        return out

    def new(self, b: int, t: int) -> torch.Tensor:
        return self._view("_new", b, t)

    def scatter(self, caches: list[KVCache], new: torch.Tensor) -> None:
        scatter_new(caches, new)


def gather_past(caches: list[KVCache], out: torch.Tensor, spans: list[tuple[int, int]] | None = None) -> int:
    """Copy rows [start, end) of each row's slot into out[2L*Hkv, B, C, D], spans[b] = (start, end);
    default: every row's [0, C) (C = out.shape[2]). Returns the rows copied."""
    copied = 0
    for b, cache in enumerate(caches):
        start, end = spans[b] if spans else (0, out.shape[2])
        if end > start:
            s = cache.spec
            out[:, b, start:end].unflatten(0, (s.num_layers, 2, s.num_kv_heads)).copy_(
                cache.buf[:, :, :, start:end], non_blocking=True)
            copied += end - start
    return copied


def scatter_new(caches: list[KVCache], new: torch.Tensor) -> None:
    """Copy row b's new keys/values new[2L*Hkv, b, T] into its slot at `caches[b].used`."""
    t = new.shape[2]
    for b, cache in enumerate(caches):
        u = cache.used
        s = cache.spec
        cache.buf[:, :, :, u:u + t].copy_(new[:, b].unflatten(0, (s.num_layers, 2, s.num_kv_heads)))
