"""StagedBucket: fixed-address buffers for one bucketed step shape, shared by the graph backends.

A captured graph (torch CUDA graphs, TensorRT + CUDA graphs, ONNX Runtime `enable_cuda_graph`)
replays with the addresses it was captured with. A batch's rows live in pool slots that change from
step to step, and a step's new rows land at each row's `used`, which moves; so the graph reads the
past from, and writes the new keys/values into, staging buffers here: `load` copies the inputs and
each row's past in, `scatter_new_kv` copies the new rows out into the slots after each replay. The
graph never touches a live cache row, so warm-up and capture cannot corrupt one.

Ordering: the copies are queued on the current stream; an engine that runs on another stream (or
inside ONNX Runtime) calls `after_inputs(stream)` first, the one policy for all graph engines.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..export.spec import ModelSpec
from ..runtime.kv_cache import KVCache, gather_past, scatter_new

INPUTS = ("input_ids", "position_ids", "attn_mask", "logit_rows")


@dataclass
class StagedBucket:
    inputs: dict[str, torch.Tensor]
    past: torch.Tensor           # [2L*Hkv, B, C, D]
    new_kv: torch.Tensor         # [2L*Hkv, B, T, D]
    logits: torch.Tensor         # [B, R, V]
    hidden: torch.Tensor | None = None   # [B, R, hidden_size] float32: a model's hidden rows (contract v4)
    runs: int = 0
    graph: object | None = None

    @classmethod
    def make(cls, spec: ModelSpec, kv_dtype: torch.dtype, device, b: int, t: int, total: int, r: int,
             hidden: bool = False) -> "StagedBucket":
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(inputs={"input_ids": z(b, t), "position_ids": z(b, t),
                           "attn_mask": z(b, t, total, dtype=torch.bool), "logit_rows": z(b, r)},
                   past=z(2 * spec.num_layers * spec.num_kv_heads, b, total - t, spec.head_dim, dtype=kv_dtype),
                   new_kv=z(2 * spec.num_layers * spec.num_kv_heads, b, t, spec.head_dim, dtype=kv_dtype),
                   logits=z(b, r, spec.vocab_size, dtype=torch.float32),
                   hidden=z(b, r, spec.hidden_size, dtype=torch.float32) if hidden else None)

    def load(self, caches: list[KVCache], input_ids, position_ids, attn_mask, logit_rows) -> None:
        for name, x in zip(INPUTS, (input_ids, position_ids, attn_mask, logit_rows)):
            self.inputs[name].copy_(x, non_blocking=True)
        gather_past(caches, self.past)

    def scatter_new_kv(self, caches: list[KVCache]) -> None:
        scatter_new(caches, self.new_kv)


def after_inputs(stream: "torch.cuda.Stream | None" = None) -> None:
    """Order a graph's work after the input copies queued on the current stream: `stream` waits on
    it (no host sync), or, for a runtime with streams of its own (ONNX Runtime), the host waits."""
    if not torch.cuda.is_available():
        return
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    else:
        torch.cuda.current_stream().synchronize()
