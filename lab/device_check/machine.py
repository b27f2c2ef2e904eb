"""The machine: the card and its software, and the two ceilings every cost is judged against: the
copy bandwidth (bytes read + written per second, a device-to-device copy) and the bf16 matmul rate."""
from __future__ import annotations

import os
import platform
import subprocess

import torch

from .timing import is_cuda, median


def machine(device: str, tiny: bool) -> dict:
    out = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "host": platform.node(), "cpus": _cpus()}
    if is_cuda(device):
        props = torch.cuda.get_device_properties(device)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                   multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                   driver=_driver())
    else:
        out.update(gpu=None, cpu=platform.processor() or platform.machine())
    out.update(ceilings(device, tiny))
    return out


def ceilings(device: str, tiny: bool) -> dict:
    n = (64 if tiny else 4096) * 2**20                     # bytes copied: far beyond any cache on a GPU
    x = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    y = torch.empty_like(x)
    copy_s = median(lambda: y.copy_(x), device, repeats=5 if tiny else 20)
    del x, y
    m = 256 if tiny else 8192
    dtype = torch.bfloat16 if is_cuda(device) else torch.float32     # this CPU has no bf16 GEMM
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, m, device=device, dtype=dtype, generator=gen)
    b = torch.randn(m, m, device=device, dtype=dtype, generator=gen)
    mm_s = median(lambda: a @ b, device, repeats=5 if tiny else 20)
    return {"copy_bytes": 2 * n, "copy_gb_per_s": round(2 * n / copy_s / 1e9, 1),
            "matmul": f"{m}x{m}x{m} {str(dtype).removeprefix('torch.')}",
            "matmul_tflop_per_s": round(2 * m**3 / mm_s / 1e12, 2)}


def _driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20)
        return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
