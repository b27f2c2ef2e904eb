"""What exactness costs: the 8B-shaped target's decode step under each setting (settings.py), as
the runtime would run it, replayed as a CUDA graph and timed with CUDA events (median of 30):
`plain` one token after C cached; `fixed` the one token bucket (16 rows, every row's logits) over
the slot's whole KV buffer (C + 16), cuBLAS without reduced-precision reductions or split-K;
`fixed-fp64` that with attention and the KV cache in float64. B = 1 and 8."""
from __future__ import annotations

import time

import torch

from . import settings as S
from .costs import _free, random_model, shapes, steps
from .timing import median


def setting_costs(device: str, tiny: bool, deadline: float) -> dict:
    spec = shapes(tiny)["target"]
    model = random_model(spec, device)
    cached = (64,) if tiny else (512, 4096)
    out: dict = {"token_bucket": S.TOKENS, "rows": []}
    for setting in S.SETTINGS:                   # fp64 last: it changes the model in place
        if setting == "fixed-fp64":
            model.exact_attention(torch.float64)
        for b in (1, 2) if tiny else (1, 8):
            for c in cached:
                t, ctx = (1, c) if setting == "plain" else (S.TOKENS, c + S.TOKENS)
                row = {"setting": setting, "B": b, "C": c, "T": t, "buffer": ctx}
                if time.monotonic() > deadline:
                    out["rows"].append({**row, "skipped": "out of time"})
                    continue
                past = torch.zeros(2 * spec.num_layers * spec.num_kv_heads, b, ctx, spec.head_dim,
                                   dtype=model.kv_dtype, device=device)
                with S.matmul_flags(setting):
                    step, replay, error = steps(model, past, b, t, ctx, device, graphs=True)
                    row.update(graphs=replay is not None, ms=round(1e3 * median(replay or step, device, 30), 4))
                if error:
                    row["graph_error"] = error
                out["rows"].append(row)
                del step, replay, past
                _free(device)
    return out
