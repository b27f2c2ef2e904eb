"""KVCache: one preallocated buffer per model, written in place, committed by compaction.

Layout: `buf[L, 2, S_max, Hkv, D]`, sequence-major, so `buf[l, j, :C]` (the past of layer l) and
`buf[l, j, C:C+T]` (where the step's new rows go) are each one contiguous block. ONNX Runtime and
TensorRT then bind both straight onto the buffer: the cache is never copied or reallocated between
steps. (Inside a step, attention still concatenates each layer's past with the new rows: a
temporary copy that grows with the context; see docs/ARCHITECTURE.md.)

Rows [0, length) are committed tokens. A step appends T rows after them as *scratch* (a token tree
being verified, or draft nodes being expanded). `commit(rows)` keeps the accepted scratch rows, in
order, right after the committed prefix (a no-op when they already are), and drops the rest.
"""
from __future__ import annotations

import numpy as np
import torch

from ..errors import TrtspecError
from ..export.spec import ModelSpec


class CapacityError(TrtspecError, RuntimeError):
    """The request does not fit the KV capacity (max_seq_len)."""


class KVCache:
    def __init__(self, spec: ModelSpec, capacity: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.spec = spec
        self.capacity = capacity
        self.buf = torch.zeros(spec.num_layers, 2, capacity, spec.num_kv_heads, spec.head_dim,
                               dtype=dtype, device=device)
        self.length = 0    # committed rows
        self.scratch = 0   # uncommitted rows written after them

    @property
    def used(self) -> int:
        return self.length + self.scratch

    def past(self, rows: int | None = None) -> list[torch.Tensor]:
        """Views [k0, v0, k1, v1, ...] of the first `rows` rows (default: every row written so far).
        More rows than `used` is a cache-length bucket: the extra stale rows are masked out."""
        u = self.used if rows is None else rows
        return [self.buf[l, j, :u] for l in range(self.spec.num_layers) for j in (0, 1)]

    def slots(self, t: int) -> list[torch.Tensor]:
        """Views of the next t rows, where a step writes its new keys/values."""
        u = self.used
        if u + t > self.capacity:
            raise CapacityError(
                f"the sequence needs {u + t} KV rows but the cache holds {self.capacity}; "
                "raise max_seq_len in the config (or shorten the prompt / max_new_tokens)")
        return [self.buf[l, j, u:u + t] for l in range(self.spec.num_layers) for j in (0, 1)]

    def advance(self, t: int) -> None:
        self.scratch += t

    def commit(self, rows) -> None:
        """Keep scratch rows `rows` (indices relative to `length`, ascending) as committed tokens."""
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        if n and not (rows[-1] == n - 1):  # rows ascending and unique: prefix iff last == n-1
            idx = torch.from_numpy(rows + self.length).to(self.buf.device)
            self.buf[:, :, self.length:self.length + n] = self.buf[:, :, idx]
        self.length += n
        self.scratch = 0

    def rollback(self) -> None:
        self.scratch = 0

    def reset(self) -> None:
        self.length = 0
        self.scratch = 0
