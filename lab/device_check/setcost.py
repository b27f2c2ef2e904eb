"""What exactness costs: the 8B-shaped target's decode step under each setting (settings.py), as
the runtime would run it, replayed as a CUDA graph and timed with CUDA events (median of 30):
`plain` one token after C cached; `fixed` the one token bucket (16 rows, every row's logits) over
the slot's whole KV buffer (C + 16), cuBLAS without reduced-precision reductions or split-K;
`fixed-fp64` that with attention and the KV cache in float64; `logical` fixed's shape with attention
in bf16 by logical order over the KV pool in place (engines/logical_engine.py), timed as the engine's
whole step (its inputs' upload and the rows' keys included), its graphs captured by the engine.
B = 1 and 8; C = 512, 4,096 and 16,384 (fp64 to 4,096)."""
from __future__ import annotations

import time

import torch

from . import settings as S
from .costs import _free, random_model, shapes, steps
from .timing import is_cuda, median


def setting_costs(device: str, tiny: bool, deadline: float) -> dict:
    spec = shapes(tiny)["target"]
    model = random_model(spec, device)
    cached = (64,) if tiny else (512, 4096, 16384)     # (fp64 at 16,384 and B = 8: 69 GB of KV, left out)
    out: dict = {"token_bucket": S.TOKENS, "rows": []}
    for setting in sorted(S.SETTINGS, key=lambda s: s == "fixed-fp64"):    # fp64 last: it changes the model in place
        if setting == "logical" and not is_cuda(device):
            out["rows"].append({"setting": setting, "skipped": "needs a GPU"})
            continue
        if setting == "fixed-fp64":
            model.exact_attention(torch.float64)
        for b in (1, 2) if tiny else (1, 8):
            for c in cached:
                if setting == "fixed-fp64" and c > 4096:
                    continue
                t, ctx = (1, c) if setting == "plain" else (S.TOKENS, c + S.TOKENS)
                row = {"setting": setting, "B": b, "C": c, "T": t, "buffer": ctx}
                if time.monotonic() > deadline:
                    out["rows"].append({**row, "skipped": "out of time"})
                    continue
                past = torch.zeros(2 * spec.num_layers * spec.num_kv_heads, b, ctx, spec.head_dim,
                                   dtype=model.kv_dtype, device=device)
                with S.matmul_flags(setting):
                    if setting == "logical":
                        step, replay, error = logical_step(model, b, c, device), None, None
                        row.update(graphs=True, ms=round(1e3 * median(step, device, 30), 4))
                    else:
                        step, replay, error = steps(model, past, b, t, ctx, device, graphs=True)
                        row.update(graphs=replay is not None, ms=round(1e3 * median(replay or step, device, 30), 4))
                if error:
                    row["graph_error"] = error
                out["rows"].append(row)
                del step, replay, past
                _free(device)
    return out


def logical_step(model, b: int, c: int, device: str):
    """The logical engine's step as the runtime runs it: B slots of a pool with `c` committed rows
    each, one token-bucket step (a 16-node chain) per slot; returns the step (the engine replays its
    CUDA graph)."""
    from trtspec.engines.logical_engine import LogicalTorchEngine
    eng = LogicalTorchEngine(model, device, cuda_graphs=True)
    pool = eng.new_pool(b, c + S.TOKENS)
    for cache in pool.caches:
        cache.rewind(c, 0)
    t = S.TOKENS
    ids = torch.zeros(b, t, dtype=torch.int64, device=device)
    pos = (c + torch.arange(t, device=device)).expand(b, t).contiguous()
    mask = torch.ones(b, t, c + t, dtype=torch.bool, device=device)
    mask[:, :, c:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    rows = torch.arange(t, device=device).expand(b, t).contiguous()

    def step():
        return eng.step_batch(pool.caches, ids, pos, mask, rows)
    return step
