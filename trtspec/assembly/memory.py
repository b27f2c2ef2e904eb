"""Will an engine folder fit in this machine's memory with `slots` KV slots? Asked before loading.

What a Generator holds, per model role: its weights (the folder's files for that role, which is what
the backend loads; a head role has weights only), its KV pool `[L, 2, slots, capacity + headroom,
Hkv, D]`, and, with more than one slot, the batch staging copy of the rows' pasts
(runtime/kv_cache.BatchStaging: up to the pool's size again). `fit` compares their sum with the
memory the kernel says is available (MemAvailable, or a cgroup's limit if lower) and refuses in one
line with the bytes, and the largest `slots` and `max_seq_len` that would fit, rather than a raw
allocator error or the OOM killer later.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..engines.manifest import EngineError, is_head
from ..export.spec import DTYPES, ModelSpec
from ..runtime.batch import MAX_BATCH_TOKENS

GIB = 1 << 30
SLACK = 0.9          # what may be planned of the available memory (the runtime, Python, allocator)


@dataclass
class Need:
    weights: dict[str, int]        # role -> bytes
    row_bytes: dict[str, int]      # role -> bytes of one KV row (one position, every layer, K and V)
    rows: int                      # KV rows a slot holds (capacity + headroom)
    slots: int
    stored: int = 0                # rows of the prefix cache's store (runtime/prefix_cache.py)

    def pool(self, role: str, slots: int | None = None, rows: int | None = None) -> int:
        s = self.slots if slots is None else slots
        r = self.rows if rows is None else rows
        return self.row_bytes[role] * r * s * (2 if s > 1 else 1)      # pool + batch staging

    def total(self, slots: int | None = None, rows: int | None = None) -> int:
        return sum(self.weights.values()) + sum(self.pool(role, slots, rows) + self.row_bytes[role] * self.stored
                                                for role in self.row_bytes)


def need(folder: Path, manifest: dict, capacity: int, slots: int, stored: int = 0) -> Need:
    weights, row_bytes = {}, {}
    for role, info in manifest["models"].items():
        weights[role] = sum(f["bytes"] for rel, f in manifest.get("files", {}).items() if rel.startswith(f"{role}/"))
        if is_head(info):                      # no KV cache
            continue
        spec = ModelSpec.from_dict(info["spec"])
        elt = DTYPES[info["dtype"]].itemsize if not info.get("quantize") else 4   # quantized graphs keep fp32 KV
        elt = 8 if info.get("attention") == "fp64" else elt                        # ... or fp64 (exact attention)
        row_bytes[role] = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * elt
    return Need(weights, row_bytes, capacity + MAX_BATCH_TOKENS, slots, stored)


def available_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, capped by a cgroup v2/v1 limit and by
    TRTSPEC_MEMORY_LIMIT (bytes; an operator sharing the machine); None if unknown."""
    avail = None
    if os.environ.get("TRTSPEC_MEMORY_LIMIT", "").isdigit():
        avail = int(os.environ["TRTSPEC_MEMORY_LIMIT"])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room = int(line.split()[1]) * 1024
                avail = room if avail is None else min(avail, room)
    except OSError:
        pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            cap = Path(limit).read_text().strip()
            if cap.isdigit() and int(cap) < 1 << 60:
                room = int(cap) - int(Path(usage).read_text().strip())
                avail = room if avail is None else min(avail, room)
        except (OSError, ValueError):
            continue
    return avail


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


def fit(folder: Path, manifest: dict, capacity: int, slots: int, available: int | None = None,
        stored: int = 0) -> Need:
    """EngineError unless weights + KV pools + prefix stores fit in the available memory (checked
    before loading)."""
    n = need(folder, manifest, capacity, slots, stored)
    avail = available_bytes() if available is None else available
    if avail is None:
        return n
    budget = int(avail * SLACK)
    if n.total() <= budget:
        return n
    best_slots = next((s for s in range(slots - 1, 0, -1) if n.total(slots=s) <= budget), 0)
    per_row = sum(n.pool(role, rows=1) for role in n.row_bytes)    # at the given slots
    best_len = (budget - sum(n.weights.values())) // per_row - MAX_BATCH_TOKENS if per_row else 0
    parts = ", ".join([f"weights {gib(sum(n.weights.values()))}"] +
                      [f"{role} KV pool {gib(n.pool(role))}" for role in n.row_bytes] +
                      ([f"prefix cache {gib(sum(n.row_bytes.values()) * stored)}"] if stored else []))
    advice = []
    if best_slots:
        advice.append(f"at most {best_slots} slots (--max-batch / slots) at max_seq_len {capacity}")
    if best_len >= 16:
        advice.append(f"max_seq_len at most {int(best_len)} with {slots} slots")
    if stored:
        advice.append("a smaller prefix_cache (tokens; 0 = off)")
    fix = "; ".join(advice) if advice else "the weights alone do not fit: use a smaller or quantized model"
    raise EngineError(f"{folder} with {slots} slots of {capacity} tokens needs {gib(n.total())} ({parts}; "
                      f"with more than one slot the pools include the batch staging copy) but this machine has "
                      f"{gib(avail)} available; fits: {fix}")
