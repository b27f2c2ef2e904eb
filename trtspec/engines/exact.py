"""Exact on a GPU by construction (docs/design.md, "Exact on a GPU by construction"): a torch
target whose every decode step, `ar` included, runs at one padded shape, with attention and its KV
cache in float64 and cuBLAS without reduced-precision reductions or split-K. Measured on an H200
(docs/bench/gpu/h200-2026-11-28/): tree rows then carry the logits of the same path fed one token
per forward, bit for bit, and every strategy's greedy output equals `ar`'s; without it they do not.

The shape is the Batcher's: one token bucket (`TOKENS`, or the config's one) with the logit rows
padded to it (`fixed_rows`), and one cache bucket. A step larger than the bucket would run at a
shape of its own, so the config refuses strategies whose trees do not fit (assembly/config.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

TOKENS = 16          # the one token bucket by default: a tree of up to 15 nodes after its root


def exact_engine(make, model):
    """`make(model)` (a torch engine class) built exact: the model's attention and KV in float64 (the
    engine's KV pool takes the model's dtype), the logit rows of a one-row call padded to the bucket
    (the Batcher reads `fixed_rows`), and every step under `matmul_flags` (`exact`)."""
    engine = make(model.exact_attention(torch.float64))
    engine.fixed_rows = True
    engine.exact = True
    return engine


_FORM: tuple | None = None            # the flag form this device accepts, once probed


@contextmanager
def matmul_flags(on: bool = True):
    """cuBLAS without reduced-precision reductions and split-K, and no TF32, for the duration.

    torch >= 2.10 takes (reduced precision, split-K) tuples; split-K off needs the cuBLASLt backend,
    which a matmul refuses only when it runs, so the first use probes one matmul per dtype and keeps
    the first form the device accepts (found by the first H200 run)."""
    if not on:
        yield
        return
    m = torch.backends.cuda.matmul
    names = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
    saved = (*(getattr(m, n) for n in names), m.allow_tf32, torch.backends.cuda.preferred_blas_library())
    try:
        m.allow_tf32 = False
        _apply(_form())
        yield
    finally:
        for n, v in zip(names, saved):
            setattr(m, n, v)
        m.allow_tf32 = saved[2]
        torch.backends.cuda.preferred_blas_library(saved[3])


FORMS = (("cublas", (False, False)), ("cublaslt", (False, False)), ("cublas", False))


def _apply(form: tuple) -> None:
    blas, flag = form
    torch.backends.cuda.preferred_blas_library(blas)
    for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
        setattr(torch.backends.cuda.matmul, name, flag)


def _form() -> tuple:
    global _FORM
    if _FORM is None:
        for form in FORMS:
            try:
                _apply(form)
                if torch.cuda.is_available():
                    for dt in (torch.float16, torch.bfloat16, torch.float32):
                        x = torch.ones(4, 8, device="cuda", dtype=dt)
                        torch.nn.functional.linear(x, x)
                _FORM = form
                break
            except (TypeError, RuntimeError):
                continue
        else:
            _FORM = ("cublas", False)
    return _FORM
