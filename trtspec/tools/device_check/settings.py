"""The exactness settings a CUDA target can run under, and the engines they make.

- `plain`: the eager torch engine as it runs today: every step at its own shape, cuBLAS free to
  pick kernels (GEMV for one row, split-K, reduced-precision reductions) per shape.
- `fixed`: every target step at one padded shape (one token bucket, `TOKENS`, for `ar` and trees
  alike, logit rows padded to it too, and one cache bucket: attention reads the slot's whole
  fixed-size KV buffer under the mask), with reduced-precision reductions and split-K off in cuBLAS. The same kernels then run for
  a tree row and for the same path fed one token per forward.
- `fixed-fp64`: `fixed`, and attention (with the KV cache) in float64, so a row's attention output
  does not depend on where its ancestors sit in the buffer (the CPU's exact attention).

`+graphs` runs the same setting's steps as CUDA graphs (one per bucketed shape).
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from ...engines.cuda_graphs import GraphedTorchEngine
from ...engines.torch_engine import TorchEngine
from ...export.model import Decoder

TOKENS = 16           # the one token bucket: a tree of up to 15 nodes after its root, or one token
SETTINGS = ("plain", "fixed", "fixed-fp64")


def buckets(setting: str, capacity: int) -> dict | None:
    return None if setting == "plain" else {"tokens": [TOKENS], "cache": [capacity]}


def engine(model: Decoder, setting: str, device: str, graphs: bool = False):
    """The target's engine under `setting` (its own copy of the model where the setting changes it)."""
    if setting == "fixed-fp64":
        model = copy.deepcopy(model).exact_attention(torch.float64)
    eng = (GraphedTorchEngine if graphs else TorchEngine)(model, device)
    eng.fixed_rows = setting != "plain"           # the Batcher pads one-row calls' logit rows too
    return eng


@contextmanager
def matmul_flags(setting: str):
    """cuBLAS reductions for the duration of a setting: full precision and no split-K unless `plain`.

    torch >= 2.10 takes (reduced precision, split-K); split-K off needs the cuBLASLt backend, which
    a matmul only refuses when it runs, so a probe picks the first form the device accepts."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction, m.allow_tf32)
    blas = torch.backends.cuda.preferred_blas_library()
    try:
        if setting != "plain":
            m.allow_tf32 = False
            for lt, flag in ((False, (False, False)), (True, (False, False)), (False, False)):
                if lt:
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                try:
                    for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
                        setattr(m, name, flag)
                    if torch.cuda.is_available():
                        for dt in (torch.float16, torch.bfloat16, torch.float32):
                            x = torch.ones(4, 8, device="cuda", dtype=dt)
                            torch.nn.functional.linear(x, x)
                    break
                except (TypeError, RuntimeError):
                    torch.backends.cuda.preferred_blas_library(blas)
        yield
    finally:
        m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction, m.allow_tf32 = saved
        torch.backends.cuda.preferred_blas_library(blas)
