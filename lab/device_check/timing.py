"""Timing on the device a check runs on: CUDA events on a GPU, the host clock on a CPU."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def is_cuda(device: str) -> bool:
    return str(device).startswith("cuda")


def times(fn: Callable[[], object], device: str, repeats: int, warmup: int = 3) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    if not is_cuda(device):
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    torch.cuda.synchronize()
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in marks:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in marks]


def median(fn: Callable[[], object], device: str, repeats: int, warmup: int = 3) -> float:
    return statistics.median(times(fn, device, repeats, warmup))

