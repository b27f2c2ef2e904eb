"""The whole loop with forced acceptance: the target as its own draft (every proposal accepted),
and that draft corrupted at fixed rates (a corrupted row's logits are rolled by one token, so its
proposal is wrong and rejected), against `ar` in the same run: tokens per second, tokens per target
step, the share of a step spent outside the forwards, and every output equal to `ar`'s. The
product's form (the target exact by one step shape, engines/exact.py, as CUDA graphs on a GPU; its
draft the same weights at the plain setting) and plain eager steps."""
from __future__ import annotations

import copy
import time

import torch

from trtspec.options import MAX_STEP_TOKENS
from trtspec.runtime.engine import Engine
from trtspec.runtime.generator import Generator
from . import settings as S
from .costs import random_model, shapes
from .timing import is_cuda

RATES = (0.0, 0.2, 0.5)
STRATEGIES = ("chain:k=4", "staged:budget=15:stage2=false")
# Random weights give near-uniform next-token distributions (every top logit a near tie, and
# best-first trees wide and shallow); the LM head scaled up makes them peaked, as a trained
# model's are (top probability ~0.75 on the tiny shapes). Step times do not depend on it.
PEAK = 16.0


class Corrupted(Engine):
    """A draft engine whose rows are wrong at `rate`: each logits row rolled by one token with that
    probability (a seeded generator of its own, on the device)."""

    def __init__(self, inner: Engine, rate: float, seed: int = 0):
        self.inner, self.rate = inner, rate
        self.spec, self.kv_dtype, self.device = inner.spec, inner.kv_dtype, inner.device
        self.logits_in_own_buffer = inner.logits_in_own_buffer
        self.fixed_rows = getattr(inner, "fixed_rows", False)       # the Batcher reads it off the engine
        self.gen = torch.Generator(device=inner.device).manual_seed(seed)

    def step_batch(self, caches, input_ids, position_ids, attn_mask, logit_rows):
        logits = self.inner.step_batch(caches, input_ids, position_ids, attn_mask, logit_rows)
        if self.rate == 0:
            return logits
        pick = torch.rand(logits.shape[:-1], generator=self.gen, device=logits.device) < self.rate
        return torch.where(pick[..., None], logits.roll(1, -1), logits)

    def close(self) -> None:
        self.inner.close()


def e2e(device: str, tiny: bool, deadline: float) -> dict:
    new = 16 if tiny else 128
    model = random_model(shapes(tiny)["target"], device)
    with torch.no_grad():
        model.lm_head.weight.mul_(PEAK)
    prompt = torch.randint(0, model.spec.vocab_size, (64,), generator=torch.Generator().manual_seed(3)).tolist()
    capacity = len(prompt) + new + MAX_STEP_TOKENS     # room for a step's largest call
    out = {"new_tokens": new, "prompt_tokens": len(prompt), "runs": []}
    # On a GPU the logical target first (issue 61: what is to replace fixed-fp64), then the product's
    # form (the exact target as CUDA graphs, its draft at the same buckets; on a CPU the graph engine
    # runs eagerly): eager steps of the 8B shape are slow, so a short budget ends in the plain runs.
    forms = (("logical", True),) if is_cuda(device) else ()
    for setting, graphs in forms + (("fixed-fp64", True), ("plain", False)):
        exact = copy.deepcopy(model) if setting == "fixed-fp64" else None   # made fp64 once, by its engine
        with S.matmul_flags(setting):
            ref = None
            for strat in ("ar",) + STRATEGIES:
                for rate in ((0.0,) if strat == "ar" else RATES):
                    if time.monotonic() > deadline:
                        out["runs"].append({"setting": setting, "graphs": graphs, "strategy": strat, "rate": rate,
                                            "skipped": "out of time"})
                        continue
                    row = run(model, exact, setting, graphs, device, strat, rate, prompt, new, capacity)
                    tokens = row.pop("tokens")
                    ref = tokens if strat == "ar" else ref
                    row["equal_to_ar"] = tokens == ref
                    out["runs"].append({"setting": setting, "graphs": graphs, "strategy": strat, "rate": rate, **row})
    return out


def run(model, exact, setting, graphs, device, strat, rate, prompt, new, capacity) -> dict:
    """One timed generation; the target is `exact` (fp64) under fixed-fp64, the draft `model` plain
    under every setting."""
    target = S.engine(exact if exact is not None else model, setting, device, graphs, own_copy=False)
    draft = Corrupted(S.engine(model, "plain", device, graphs), rate)
    gen = Generator(target, draft, capacity=capacity, buckets=S.buckets(setting, capacity), slots=1)
    try:
        gen.generate(prompt, strategy=strat, max_new_tokens=new, ignore_eos=True)     # warm-up, captures
        for b in gen.batchers.values():
            b.timed = True
            b.reset_timing()
        t0 = time.perf_counter()
        res = gen.generate(prompt, strategy=strat, max_new_tokens=new, ignore_eos=True)
        wall = time.perf_counter() - t0
        forwards = sum(sum(b.seconds.values()) for b in gen.batchers.values())
        steps = res.stats["target_steps"]
        return {"tokens": res.token_ids, "tokens_per_s": round(len(res.token_ids) / wall, 2),
                "tokens_per_step": round(res.stats["mean_accepted"], 3), "target_steps": steps,
                "ms_per_step": round(1e3 * wall / steps, 3),
                "outside_forwards_ms_per_step": round(1e3 * (wall - forwards) / steps, 3),
                "outside_share": round((wall - forwards) / wall, 4)}
    finally:
        gen.close()
        target.close()
        draft.close()
