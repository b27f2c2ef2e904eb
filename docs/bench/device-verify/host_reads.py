"""Host reads per target step, by strategy: what verification reads and what drafting reads.

A host read is any call that brings a tensor's values to the host (`.tolist()`, `.item()`,
`int(t)`, `.cpu()`, a value-dependent shape): on a GPU each one waits for the device. The engines'
own forwards are not counted (a CUDA graph or TensorRT plan replays them). Runs on the CPU with a
tiny random pair (the counts depend on the code, not on the device or the weights).

    python docs/bench/device-verify/host_reads.py [--tokens 48] [--json out.jsonl]
"""
from __future__ import annotations

import argparse
import json
from collections import Counter

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.runtime import verify as verify_mod
from trtspec.runtime.decode import DecodeState
from trtspec.runtime.runner import ModelRunner, drive
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import STRATEGIES, make_strategy

READS = {"item", "tolist", "numpy", "cpu", "__array__", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "masked_select"}
OPTIONS = {"ngram": {}, "chain": {"k": 4}, "staged": {"budget": 16}, "dyspec": {"budget": 16},
           "gsd": {"budget": 16}, "cascade": {"k_draft": 4}}


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.counts = {"draft": Counter(), "verify": Counter()}
        self.phase, self.paused = "draft", False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        bool_index = name == "__getitem__" and any(
            isinstance(x, torch.Tensor) and x.dtype == torch.bool
            for x in (args[1] if isinstance(args[1], tuple) else (args[1],)))
        if not self.paused and (name in READS or bool_index):
            self.counts[self.phase][name] += 1
        return func(*args, **(kwargs or {}))


def run(name: str, sampling: SamplingParams, target, draft, tokens: int) -> dict:
    reads = HostReads()
    for engine in (target, draft):
        forward = engine.step_batch

        def uncounted(*args, _forward=forward, **kwargs):
            reads.paused = True
            try:
                return _forward(*args, **kwargs)
            finally:
                reads.paused = False
        engine.step_batch = uncounted
    strat = make_strategy(name, **OPTIONS.get(name, {}))
    t_run = ModelRunner.alone(target, 256)
    d_run = ModelRunner.alone(draft, 256, ) if strat.needs_draft else None
    seq = np.zeros(256, dtype=np.int64)
    st = DecodeState(t_run, d_run, sampling, torch.Generator().manual_seed(0), seq, 0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    st.append(prompt)
    drive(t_run.prefill(prompt[:-1]))
    if d_run is not None:
        drive(d_run.prefill(prompt[:-1]))
    orig = DecodeState.verify_and_commit

    def verify_phase(self, *args, **kwargs):
        reads.phase = "verify"
        try:
            return (yield from orig(self, *args, **kwargs))
        finally:
            reads.phase = "draft"
    DecodeState.verify_and_commit = verify_phase
    walk = verify_mod.sampling_choice
    verify_mod.sampling_choice = lambda *a: walk(*a, early_exit=False)     # the walk as a GPU runs it
    try:
        with reads:
            while st.length < len(prompt) + tokens:
                st.append(drive(strat.step(st)))
    finally:
        DecodeState.verify_and_commit, verify_mod.sampling_choice = orig, walk
        for engine in (target, draft):
            del engine.step_batch
    steps = len(st.steps)
    return {"strategy": name, "sampling": "greedy" if sampling.greedy else "sampled", "steps": steps,
            "tokens": st.length - len(prompt),
            "verify_reads_per_step": sum(reads.counts["verify"].values()) / steps,
            "draft_reads_per_step": sum(reads.counts["draft"].values()) / steps,
            "draft_reads": dict(reads.counts["draft"].most_common(4))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=48, help="tokens to generate per strategy")
    ap.add_argument("--json", help="also write one JSON line per run here")
    args = ap.parse_args()
    spec = tiny_spec(vocab_size=512)
    target, draft = (TorchEngine(m) for m in tiny_pair(spec, seed=0))
    rows = [run(name, sp, target, draft, args.tokens) for name in STRATEGIES
            for sp in (SamplingParams(), SamplingParams(temperature=0.8))]
    print(f"{'strategy':<9} {'sampling':<8} {'steps':>5} {'verify reads/step':>18} {'draft reads/step':>17}  most common")
    for r in rows:
        print(f"{r['strategy']:<9} {r['sampling']:<8} {r['steps']:>5} {r['verify_reads_per_step']:>18.2f} "
              f"{r['draft_reads_per_step']:>17.1f}  {r['draft_reads']}")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
