"""StagedBucket: fixed-address buffers for one bucketed step shape, shared by the graph backends.

A captured graph (TensorRT + CUDA graphs, ONNX Runtime `enable_cuda_graph`) replays with the
addresses it was captured with. The past is bound to `buf[l, j, :C]` (fixed for a cache-length
bucket), but a step's new rows land at `used`, which moves; so the graph writes new keys/values into
staging buffers here, and `scatter_new_kv` copies them into the cache slots after each replay.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..export.spec import ModelSpec
from ..runtime.kv_cache import KVCache


@dataclass
class StagedBucket:
    inputs: dict[str, torch.Tensor]
    new_kv: list[torch.Tensor]
    logits: torch.Tensor
    slot: torch.Tensor
    runs: int = 0
    graph: object | None = None

    @classmethod
    def make(cls, spec: ModelSpec, kv_dtype: torch.dtype, device, t: int, total: int, r: int) -> "StagedBucket":
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(inputs={"input_ids": z(t), "position_ids": z(t), "attn_mask": z(t, total, dtype=torch.bool),
                           "logit_rows": z(r)},
                   new_kv=[z(t, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype) for _ in range(2 * spec.num_layers)],
                   logits=z(r, spec.vocab_size, dtype=torch.float32),
                   slot=z(t))

    def load(self, cache: KVCache, input_ids, position_ids, attn_mask, logit_rows) -> None:
        for name, x in zip(("input_ids", "position_ids", "attn_mask", "logit_rows"),
                           (input_ids, position_ids, attn_mask, logit_rows)):
            self.inputs[name].copy_(x, non_blocking=True)
        t = self.slot.shape[0]
        torch.arange(cache.used, cache.used + t, out=self.slot)

    def scatter_new_kv(self, cache: KVCache) -> None:
        for n, x in enumerate(self.new_kv):
            cache.buf[n // 2, n % 2].index_copy_(0, self.slot, x)
