"""Engine: the one interface every backend (torch, ONNX Runtime, TensorRT) implements.

An engine runs the step contract (docs/ARCHITECTURE.md) against a KVCache it allocated:

    logits = engine.step(cache, input_ids[T], position_ids[T], attn_mask[T, used+T], logit_rows[R])

It reads the past from `cache.past()`, writes the new tokens' keys/values into `cache.slots(T)`
and advances the cache's scratch by T. The returned float32 logits [R, V] may be a view of an
engine-owned buffer: read them before the next step.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..export.spec import ModelSpec
from ..runtime.kv_cache import KVCache


class Engine(ABC):
    name: str = "engine"
    spec: ModelSpec
    kv_dtype: torch.dtype
    device: str = "cpu"

    def new_cache(self, capacity: int) -> KVCache:
        return KVCache(self.spec, capacity, self.kv_dtype, self.device)

    @abstractmethod
    def step(self, cache: KVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
             attn_mask: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
        ...
