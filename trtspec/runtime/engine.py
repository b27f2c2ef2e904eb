"""Engine: the one interface every backend (torch, ONNX Runtime, TensorRT) implements.

An engine runs the step contract (docs/ARCHITECTURE.md, version 4) for B rows at once, each row a
request with its own KV slot:

    logits[B, R, V] = engine.step_batch(caches[B], input_ids[B, T], position_ids[B, T],
                                        attn_mask[B, T, C+T], logit_rows[B, R])

Row b reads the first C = attn_mask.shape[2] - T rows of `caches[b]` (rows past its `used` are stale
and must be masked by the caller) and writes its T new keys/values at `caches[b].used`. An engine
never moves a cache's bookkeeping: the caller (the Batcher) advances it after the step. The
interface lives in the runtime, which owns it; backends (trtspec/engines/) implement it. The
returned float32 logits may be a view of an engine-owned buffer (`logits_in_own_buffer`): read them
before the next step. `step` is the one-row form of the call.

An engine whose graph also returns the hidden rows (export/contract.py; `hidden_rows`) leaves them,
[B, R, hidden_size] float32, in `hidden` after each step, read like the logits: before the next
step (the Batcher copies each call's out at once).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..export.spec import ModelSpec
from .kv_cache import KVCache, KVPool


class Engine(ABC):
    name: str = "engine"
    spec: ModelSpec
    kv_dtype: torch.dtype
    device: str = "cpu"
    logits_in_own_buffer = False     # True: step returns a view of a buffer the next step overwrites
    hidden_rows = False              # True: each step also leaves the rows its LM head read in `hidden`
    hidden: torch.Tensor | None = None

    def new_pool(self, slots: int, capacity: int) -> KVPool:
        return KVPool(self.spec, slots, capacity, self.kv_dtype, self.device)

    def new_cache(self, capacity: int) -> KVCache:
        """A one-slot pool's cache (tools and tests that drive one sequence)."""
        return self.new_pool(1, capacity).caches[0]

    @abstractmethod
    def step_batch(self, caches: list[KVCache], input_ids: torch.Tensor, position_ids: torch.Tensor,
                   attn_mask: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        ...

    def step(self, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attn_mask: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        """One row: input_ids[T], position_ids[T], attn_mask[T, C+T], logit_rows[R] -> logits[R, V]."""
        return self.step_batch([cache], input_ids[None], position_ids[None], attn_mask[None], logit_rows[None])[0]

    def close(self) -> None:
        """Release native resources (sessions, their thread pools, device buffers) now, in a defined
        order, rather than whenever interpreter teardown gets to them. Idempotent; a closed engine
        is not stepped again."""

    @staticmethod
    def check_room(caches: list[KVCache], t: int) -> None:
        for cache in caches:
            cache.slots(t)          # raises the cache's CapacityError with its user-facing message
