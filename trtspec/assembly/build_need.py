"""What a build needs, known before it starts: peak memory and disk, from the sources' headers.

`trtspec build` (and `run --config`'s first-use build) calls `check_build` before anything is
assembled, exported or written: it reads the tensor tables of the config's sources (engines/weights
`describe`: headers only), works out each model's graph size in the form the build writes it
(dense, the GGUF's own blocks, or int4/int8 MatMulNBits), and refuses in one line where the
estimated peak exceeds the memory available (MemAvailable, a cgroup's limit, TRTSPEC_MEMORY_LIMIT)
or the files exceed the free disk at the output (and the pack cache).

The build streams (engines/stream.py): the graph is exported over fake weights and each weight is
read, converted and written alone. Its peak is then the largest of
- writing: the largest tensor in fp32 a few times over (dequantized, transposed, its blocks' codes);
- ONNX Runtime's offline optimization, which loads the written graph whole;
- the step-cost measurement after the build, which loads the folder (every model) to time it;
each above a fixed base (Python, torch, ONNX Runtime and the exporter). The coefficients are
measured (docs/benchmarks.md, "Building in a few GB"), with headroom.
"""
from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ..engines.manifest import EngineError
from .config import Config
from .memory import available_bytes, gib

BASE = 1.6e9             # the process before any weight: Python, torch, onnx, ORT, the exporter's graph
WRITE_FACTOR = 3.0       # x the largest tensor in fp32 while it is converted and written
ORT_FACTOR = 1.6         # x the written graph while ONNX Runtime optimizes it (+ its verification sessions)
LOAD_FACTOR = 1.3        # x the folder's graphs while the step costs are measured
TORCH_FACTOR = 2.2       # torch backend: x the weights (the state dict, then its safetensors bytes)

# bytes per weight of a MatMul weight the build writes as MatMulNBits terms (codes, scales, zero points /
# offsets per block), by source block type at accuracy level 4 (int8 activations) and 1 (fp32)
_WIDE = {"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"}
_GGUF_TYPES = {"Q4_0", "Q4_1", "Q4_K"} | _WIDE


@dataclass
class RoleNeed:
    role: str
    graph: int = 0             # bytes of the graph as written (≈ the folder's files for this model)
    largest: int = 0           # the largest tensor in fp32
    weights: int = 0           # every weight in the config dtype (torch backend)
    assemble: int = 0          # bytes a pack's first use writes into the cache


@dataclass
class BuildNeed:
    roles: list[RoleNeed] = field(default_factory=list)
    onnx: bool = True

    def peak(self) -> int:
        if not self.onnx:
            return int(BASE + max(TORCH_FACTOR * r.weights for r in self.roles))
        per_role = max(max(WRITE_FACTOR * r.largest, ORT_FACTOR * r.graph) for r in self.roles)
        return int(BASE + max(per_role, LOAD_FACTOR * sum(r.graph for r in self.roles)))

    def disk(self) -> int:
        """The folder's files, the largest model's twice (its plain graph and the optimized one
        coexist until the plain one is deleted), and what packs assemble into the cache."""
        sizes = [r.graph if self.onnx else r.weights for r in self.roles]
        return sum(sizes) + max(sizes) + sum(r.assemble for r in self.roles)


def _written(shape: tuple[int, ...], kind: str, mode: str, level: int, itemsize: int, matmul: bool) -> float:
    n = math.prod(shape)
    if not matmul or mode == "none" or len(shape) != 2:
        return n * itemsize
    if mode == "gguf":
        if kind not in _GGUF_TYPES:
            return n * itemsize
        bits = 8 if level == 4 and kind in _WIDE else 4 * (2 if kind in _WIDE else 1)
        return n * (bits / 8 + 8 / 16)       # codes + a scale and an offset per block (16 or 32 weights)
    return n * (int(mode[3:]) / 8 + 5 / 32)  # int4/int8: codes + an fp32 scale and a zero point per 32


def role_need(role: str, entry, onnx: bool) -> RoleNeed:
    from ..engines.quantize import ACCURACY_LEVEL, activations
    from ..engines.weights import describe, in_first_layers
    from ..export.packs import source_files

    if entry.model.startswith("tiny:"):
        return RoleNeed(role)                  # a few MB, made in memory
    spec, table = describe(entry.model)
    if entry.layers:
        table = {k: v for k, v in table.items() if in_first_layers(k, entry.layers)}
    itemsize = entry.torch_dtype.itemsize
    level = ACCURACY_LEVEL[activations(role, entry)]
    need = RoleNeed(role, assemble=source_files(entry.model)[1])
    for name, (shape, kind) in table.items():
        n = math.prod(shape)
        need.largest = max(need.largest, 4 * n)
        need.weights += n * itemsize
        matmul = name != "model.embed_tokens.weight" and len(shape) == 2
        need.graph += int(_written(shape, kind, entry.quantize, level, itemsize, matmul))
        if name == "model.embed_tokens.weight" and spec.tie_word_embeddings:    # the tied LM head too
            need.graph += int(_written(shape, kind, entry.quantize, level, itemsize, True))
    return need


def build_need(cfg: Config, onnx: bool) -> BuildNeed:
    roles = [("target", cfg.target)] + ([("draft", cfg.draft)] if cfg.draft else [])
    return BuildNeed([role_need(role, entry, onnx) for role, entry in roles], onnx)


def check_build(cfg: Config, output: Path, onnx: bool, available: int | None = None) -> BuildNeed:
    """EngineError, in one line, unless the build of `cfg` into `output` fits this machine's memory
    and disk (called before any work)."""
    from ..export.packs import cache_dir
    need = build_need(cfg, onnx)
    avail = available_bytes() if available is None else available
    peak = need.peak()
    if avail is not None and peak > avail:
        biggest = max(need.roles, key=lambda r: r.graph if onnx else r.weights)
        raise EngineError(f"building {cfg.name} needs about {gib(peak)} of memory at its peak ({biggest.role}: "
                          f"{gib(biggest.graph if onnx else biggest.weights)} of weights as built) but this machine "
                          f"has {gib(avail)} available; close other programs, raise TRTSPEC_MEMORY_LIMIT or the "
                          "container's memory limit, or build a smaller or quantized model")
    by_disk: dict[int, list] = {}                 # one line per device: the folder and the pack cache may share it
    for where, bytes_ in ((output.parent, need.disk() - sum(r.assemble for r in need.roles)),
                          (cache_dir(), sum(r.assemble for r in need.roles))):
        probe = next((p for p in (where, *where.parents) if p.exists()), None)
        if bytes_ and probe is not None:
            entry = by_disk.setdefault(probe.stat().st_dev, [probe, 0, []])
            entry[1] += bytes_
            entry[2].append(str(where))
    for probe, bytes_, wheres in by_disk.values():
        if (free := shutil.disk_usage(probe).free) < bytes_:
            raise EngineError(f"building {cfg.name} writes about {gib(bytes_)} under {' and '.join(wheres)} but that "
                              f"disk has {gib(free)} free; free some space, or choose another --output (or TRTSPEC_CACHE)")
    return need
