"""The step-cost curve on the device: one forward of the Decoder over T new tokens per row after C
cached ones, for B rows, eager and replayed as a CUDA graph, timed with CUDA events (the median of
`repeats`). Random weights of real shapes: a Llama-3-8B-shaped bf16 target and a Llama-3.2-1B-shaped
draft (timing does not depend on the weights' values). The past is a preallocated KV buffer read in
place, as the engines bind it; every T row asks for logits, as a tree verification does."""
from __future__ import annotations

import gc
import time

import torch

from trtspec.engines.cuda_graphs import capture as graph_capture
from trtspec.export.model import Decoder
from trtspec.export.spec import ModelSpec
from trtspec.export.tiny import tiny_spec
from .timing import is_cuda, median

LLAMA3_8B = dict(arch="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500_000.0, tie_word_embeddings=False,
                 attention_bias=False, max_position_embeddings=131_072)
LLAMA32_1B = dict(arch="llama", vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                  num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500_000.0, tie_word_embeddings=True,
                  attention_bias=False, max_position_embeddings=131_072)


def grid(tiny: bool) -> dict:
    if tiny:
        return dict(tokens=(1, 2, 4), cached=(16, 64), batch=(1, 2), repeats=3)
    return dict(tokens=(1, 2, 4, 8, 16, 32, 64), cached=(512, 4096, 16_384), batch=(1, 8), repeats=30)


def shapes(tiny: bool) -> dict[str, ModelSpec]:
    if tiny:
        return {"target": tiny_spec("llama", num_layers=2), "draft": tiny_spec("llama", num_layers=1)}
    return {"target": ModelSpec.from_dict(LLAMA3_8B), "draft": ModelSpec.from_dict(LLAMA32_1B)}


def random_model(spec: ModelSpec, device: str) -> Decoder:
    """A random-weight Decoder made on the device in its dtype (bf16 on a GPU), no host copy."""
    dtype = torch.bfloat16 if is_cuda(device) else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Decoder(spec)
    finally:
        torch.set_default_dtype(old)
    return model.eval().requires_grad_(False)


def weight_bytes(model: Decoder) -> int:
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())


def costs(device: str, tiny: bool, deadline: float, graphs: bool = True) -> dict:
    """The grid, B = 1 first for both models (what a projection needs), then the larger batches."""
    g = grid(tiny)
    out = {"grid": g, "models": {}, "rows": []}
    models = {role: random_model(spec, device) for role, spec in shapes(tiny).items()}
    for role, model in models.items():
        out["models"][role] = {"spec": model.spec.to_dict(), "weight_bytes": weight_bytes(model)}
    for b in g["batch"]:
        for role, model in models.items():
            spec = model.spec
            for c in g["cached"]:
                past = torch.zeros(2 * spec.num_layers * spec.num_kv_heads, b, c, spec.head_dim,
                                   dtype=model.kv_dtype, device=device)
                for t in g["tokens"]:
                    row = {"role": role, "B": b, "T": t, "C": c}
                    if time.monotonic() > deadline:
                        out["rows"].append({**row, "skipped": "out of time"})
                        continue
                    out["rows"].append({**row, **one_shape(model, past, b, t, c, device, g["repeats"], graphs)})
                del past
                _free(device)
    del models
    _free(device)
    return out


@torch.inference_mode()
def one_shape(model: Decoder, past: torch.Tensor, b: int, t: int, c: int, device: str, repeats: int,
              graphs: bool) -> dict:
    step, replay, error = steps(model, past, b, t, c, device, graphs)
    row = {"eager_ms": round(1e3 * median(step, device, repeats), 4)}
    if replay is not None:
        row["graph_ms"] = round(1e3 * median(replay, device, repeats), 4)
    if error:
        row["graph_error"] = error
    return row


def steps(model: Decoder, past: torch.Tensor, b: int, t: int, c: int, device: str, graphs: bool):
    """(the eager step, its CUDA-graph replay or None, why there is none): one forward over T new
    tokens per row after C cached, every row asking for logits."""
    ids = torch.randint(0, model.spec.vocab_size, (b, t), device=device)
    pos = (c + torch.arange(t, device=device)).expand(b, t).contiguous()
    mask = torch.ones(b, t, c + t, dtype=torch.bool, device=device).tril_(c)
    rows = torch.arange(t, device=device).expand(b, t).contiguous()
    kv = list(past.unbind(0))

    def step():
        return model(ids, pos, mask, rows, kv)

    return (step, *capture(step)) if graphs and is_cuda(device) else (step, None, None)


def capture(step):
    """(`step` captured as a CUDA graph's replay, None) or (None, why not): the engine's capture."""
    try:
        return graph_capture(step), None
    except Exception as e:                       # noqa: BLE001 - recorded, the curve goes on
        return None, f"{type(e).__name__}: {e}"[:300]


def _free(device: str) -> None:
    gc.collect()
    if is_cuda(device):
        torch.cuda.empty_cache()


def cost_model(res: dict, machine: dict | None = None) -> dict | None:
    """The measured curve as a costs.json (trtspec-costs-1) for `trtspec bench --plan-costs`: the
    B = 1 forwards as each role's table, larger B as its batched rows; CUDA-graph times where every
    shape of a table has one, else eager. None when a role's B = 1 grid is incomplete."""
    from trtspec.runtime.costs import CostModel, CostTable
    done = [r for r in res["rows"] if "skipped" not in r]
    tables: dict[str, dict[int, CostTable]] = {}
    for role in res["models"]:
        for b in sorted({r["B"] for r in done if r["role"] == role}):
            rows = [r for r in done if r["role"] == role and r["B"] == b]
            tokens, cached = sorted({r["T"] for r in rows}), sorted({r["C"] for r in rows})
            if len(rows) != len(tokens) * len(cached):
                continue
            key = "graph_ms" if all("graph_ms" in r for r in rows) else "eager_ms"
            at = {(r["C"], r["T"]): r[key] / 1e3 for r in rows}
            tables.setdefault(role, {})[b] = CostTable(tokens, cached, [[at[(c, t)] for t in tokens] for c in cached])
    if any(1 not in tables.get(role, {}) for role in res["models"]):
        return None
    meta = {"machine": (machine or {}).get("gpu") or (machine or {}).get("cpu") or "?",
            "basis": "trtspec device_check: random-weight Llama-3-8B-shaped bf16 target, Llama-3.2-1B-shaped draft; "
                     "a projection's cost table, not the Qwen pair's own costs",
            "backend": "torch-cuda-graphs", "threads": 0, "statistic": "median"}
    rows = {role: {b: t for b, t in by_b.items() if b > 1} for role, by_b in tables.items()}
    return CostModel(tables["target"][1], tables.get("draft", {}).get(1), meta,
                     {r: t for r, t in rows.items() if t}).to_dict()
