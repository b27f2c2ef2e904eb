"""Where a one-token step's time goes: the 8B-shaped target's step at B = 1, T = 1, C = 4,096 (the
goals' shape) and at B = 8, T = 1, C = 16,384 (4x slower than T = 8 in the first H200 run),
replayed as a CUDA graph under torch.profiler (eager where capture fails): kernels per step and
per layer, their summed time against the replay's, grouped as matmuls, attention and the rest, and
the costliest kernels by name. This is what the weight-read floor is missed by. Beside each, the
same shape written with torch's fused blocks (reference.py): how close fewer kernels get; and on a
GPU the product's own step, the logical engine's (engines/fused_step.py: ten kernels a layer is
issue 61's goal) at its 16-row bucket, as its CUDA graph replays it. On a CPU
(tiny) the same for the ops that compute (views and allocations left out)."""
from __future__ import annotations

import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile as torch_profile

from .costs import _free, capture, random_model, shapes, steps, weight_bytes
from . import settings as S
from .reference import Reference
from .setcost import logical_step
from .timing import is_cuda, median

STEPS = 10
PROFILED = ((1, 1, 4096), (8, 1, 16_384))          # (B, T, C)
MATMUL = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm")
ATTENTION = ("softmax", "flash", "fmha", "attention", "sdpa")
NOT_COMPUTE = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::unsqueeze",
               "aten::squeeze", "aten::transpose", "aten::expand", "aten::permute", "aten::t", "aten::slice",
               "aten::select", "aten::unbind", "aten::alias", "aten::empty", "aten::empty_strided",
               "aten::empty_like", "aten::new_empty", "aten::resolve_conj", "aten::resolve_neg", "aten::split", "aten::chunk",
               "aten::split_with_sizes", "aten::narrow", "aten::detach", "aten::contiguous", "aten::_unsafe_view",
               "aten::flatten", "aten::movedim", "aten::view_as", "aten::result_type", "aten::lift_fresh"}


@torch.inference_mode()
def profile(device: str, tiny: bool, deadline: float) -> dict:
    spec = shapes(tiny)["target"]
    model = random_model(spec, device)
    out = {"layers": spec.num_layers, "weight_bytes": weight_bytes(model), "shapes": []}
    for b, t, c in (((1, 1, 64), (2, 1, 64)) if tiny else PROFILED):
        if time.monotonic() > deadline:
            out["shapes"].append({"shape": {"B": b, "T": t, "C": c}, "skipped": "out of time"})
            continue
        past = torch.zeros(2 * spec.num_layers * spec.num_kv_heads, b, c, spec.head_dim, dtype=model.kv_dtype,
                           device=device)
        out["shapes"].append(one_profile(model, past, b, t, c, device))
        del past
        _free(device)
    return out


def one_profile(model, past, b: int, t: int, c: int, device: str) -> dict:
    """The Decoder's step at (B, T, C), and the fused yardstick's (reference.py) at the same shape."""
    step, replay, error = steps(model, past, b, t, c, device, graphs=True)
    out = {"shape": {"B": b, "T": t, "C": c}, "graph_error": error, **measure(replay or step, device, model.spec)}
    out["graphs"] = replay is not None
    del step, replay
    ref = Reference(model.spec, device, b, c + t)
    ids = torch.randint(0, model.spec.vocab_size, (b, t), device=device)

    def ref_step():
        return ref(ids, c)

    replay, error = capture(ref_step) if is_cuda(device) else (None, None)
    out["reference"] = {"graphs": replay is not None, "graph_error": error,
                        **measure(replay or ref_step, device, model.spec)}
    if is_cuda(device):         # the product's step: the logical engine's fused step (engines/fused_step.py)
        out["logical"] = {"graphs": True, "rows": S.TOKENS,
                          **measure(logical_step(model, b, c, device), device, model.spec)}
    else:
        out["logical"] = {"skipped": "needs a GPU (tests/e2e/test_fused_step.py counts its kernels on the CPU)"}
    return out


def measure(run, device: str, spec) -> dict:
    """`run`'s median time, and its kernels under the profiler: per step and layer, by group, by name."""
    out = {"step_ms": round(1e3 * median(run, device, 30), 4)}
    cuda = is_cuda(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(STEPS):
            run()
        if cuda:
            torch.cuda.synchronize()
    events = _kernels(prof.events(), cuda)
    by_name: dict[str, list[float]] = {}
    groups = {"matmul": [0, 0.0], "attention": [0, 0.0], "other": [0, 0.0]}
    for name, us in events:
        by_name.setdefault(name, []).append(us)
        g = groups[_group(name)]
        g[0], g[1] = g[0] + 1, g[1] + us
    out.update(
        kernels_per_step=round(len(events) / STEPS, 1),
        kernels_per_layer=round(len(events) / STEPS / spec.num_layers, 1),
        kernel_ms_per_step=round(sum(us for _, us in events) / STEPS / 1e3, 4),
        groups={k: {"kernels": round(n / STEPS, 1), "ms": round(us / STEPS / 1e3, 4)} for k, (n, us) in groups.items()},
        top=[{"name": name[:90], "per_step": round(len(us) / STEPS, 1), "ms": round(sum(us) / STEPS / 1e3, 4)}
             for name, us in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]])
    return out


def _kernels(events, cuda: bool) -> list[tuple[str, float]]:
    """(name, µs) of every kernel (a GPU) or computing op (a CPU: an aten op none of whose children
    computes)."""
    if cuda:
        return [(e.name, e.time_range.elapsed_us()) for e in events if e.device_type == DeviceType.CUDA]
    return [(e.name, e.time_range.elapsed_us()) for e in events
            if e.device_type == DeviceType.CPU and e.name.startswith("aten::") and e.name not in NOT_COMPUTE
            and all(ch.name in NOT_COMPUTE for ch in e.cpu_children)]


def _group(name: str) -> str:
    low = name.lower()
    return ("matmul" if any(k in low for k in MATMUL) else
            "attention" if any(k in low for k in ATTENTION) else "other")
