"""The exactness settings a CUDA target can run under, and the engines they make.

- `plain`: the eager torch engine as it runs today: every step at its own shape, cuBLAS free to
  pick kernels (GEMV for one row, split-K, reduced-precision reductions) per shape.
- `fixed`: every target step at one padded shape (one token bucket, `TOKENS`, for `ar` and trees
  alike, logit rows padded to it too, and one cache bucket: attention reads the slot's whole
  fixed-size KV buffer under the mask), with reduced-precision reductions and split-K off in
  cuBLAS. The same kernels then run for a tree row and for the same path fed one token per forward.
- `fixed-fp64`: `fixed`, and attention (with the KV cache) in float64, so a row's attention output
  does not depend on where its ancestors sit in the buffer (the CPU's exact attention). This is what
  the runtime runs a CUDA target with (engines/exact.py): the check measures the product's engine.
- `logical`: `fixed`'s one shape and flags with attention in the model's dtype, each row's keys in
  logical order, the KV pool read and written in place (engines/logical_engine.py, Triton; issue 61:
  what is to replace `fixed-fp64`). Runs on a GPU only here: on a CPU the Triton interpreter is too
  slow for these sizes (tests/e2e/test_logical_engine.py runs it on tiny ones).

`+graphs` runs the same setting's steps as CUDA graphs (one per bucketed shape).
"""
from __future__ import annotations

import copy

from trtspec.engines.cuda_graphs import GraphedTorchEngine
from trtspec.engines.exact import TOKENS, exact_engine
from trtspec.engines.exact import matmul_flags as exact_flags
from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.model import Decoder

SETTINGS = ("plain", "fixed", "fixed-fp64", "logical")


def buckets(setting: str, capacity: int) -> dict | None:
    return None if setting == "plain" else {"tokens": [TOKENS], "cache": [capacity]}


def engine(model: Decoder, setting: str, device: str, graphs: bool = False, own_copy: bool = True):
    """The target's engine under `setting`: `fixed-fp64` is the product's own construction
    (engines/exact.py, on its own copy of the model unless `own_copy` is off: then `model` itself is
    made fp64); `fixed` the same without fp64 attention."""
    def make(m):
        return (GraphedTorchEngine if graphs else TorchEngine)(m, device)

    if setting == "fixed-fp64":
        return exact_engine(make, copy.deepcopy(model) if own_copy else model)
    if setting == "logical":
        from trtspec.engines.logical_engine import LogicalTorchEngine
        return LogicalTorchEngine(model, device, cuda_graphs=graphs)
    eng = make(model)
    if setting == "fixed":
        eng.fixed_rows = eng.exact = True      # padded logit rows, and every step under the cuBLAS flags
    return eng


def matmul_flags(setting: str):
    """The cuBLAS flags of a setting (engines/exact.py) for code that runs the model directly."""
    return exact_flags(setting != "plain")
