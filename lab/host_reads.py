"""Host reads per target step, by strategy: what verification reads and what drafting reads.

A host read is any call that brings a tensor's values to the host (`.tolist()`, `.item()`,
`int(t)`, `.cpu()`, `.numpy()`, a value-dependent shape such as `nonzero` or a bool mask): on a
GPU each one waits for the device. `HostReads` (a torch function mode) counts them; the engines'
own forwards are not counted (a CUDA graph or TensorRT plan replays them). The count depends on
the code, not on the device or the weights, so a CPU and a tiny random pair measure it.
With `--batch B`, B requests of each strategy run at once through the scheduler, and the
verification reads are counted per target phase (all B requests' trees together).

    python -m lab.host_reads [--tokens 48] [--batch 4] [--json out.jsonl]
"""
from __future__ import annotations

import json
from collections import Counter

import click
import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from trtspec.runtime.decode import DecodeState
from trtspec.runtime.effects import drive
from trtspec.runtime.generator import Generator
from trtspec.runtime.hooks import Hooks
from trtspec.runtime.runner import ModelRunner
from trtspec.runtime.step import step
from trtspec.runtime.strategies import make_strategy

READS = {"item", "tolist", "numpy", "cpu", "__array__", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "masked_select"}
# Fixed budgets: the counts then depend on the drafting rule alone, not on a policy's choices.
OPTIONS = {"chain": {"k": 4}, "staged": {"budget": 16}, "dyspec": {"budget": 16}, "gsd": {"budget": 16},
           "cascade": {"k_draft": 4}}


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(x, torch.Tensor) and x.dtype == torch.bool for x in parts)


class HostReads(TorchFunctionMode, Hooks):
    """Records every host read made while it is active, under the `current` phase ("verify" or
    "draft"; thread-local: count in the thread that runs the steps). As the runtime's observer
    (runtime/hooks.py) it leaves the engines' forwards out of the count (what a replayed graph does is
    not ours), counts a request's reads as verification while its step is in verify_and_commit, and
    the scheduler's joint read after a target phase as verification too; handed to a Generator it
    enters itself for each scheduler iteration (on the scheduler's thread) and counts the phases."""

    def __init__(self, scheduled: bool = False):
        super().__init__()
        self.counts: dict[str, Counter] = {}
        self.current, self.paused, self.scheduled = "draft", False, scheduled
        self.sections: dict[int, str] = {}          # id(DecodeState) -> its step's section
        self.in_target, self.target_phases, self.draft_rounds = False, 0, 0

    @property
    def reads(self) -> list[str]:
        """Every read so far, by name, in no particular order."""
        return sorted(sum(self.counts.values(), Counter()).elements())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused and (name in READS or (name == "__getitem__" and _bool_index(args[1]))):
            self.counts.setdefault(self.current, Counter())[name] += 1
        return func(*args, **(kwargs or {}))

    # -- the runtime's hooks ------------------------------------------------------------------
    def iteration(self, start: bool) -> None:
        if self.scheduled:
            self.__enter__() if start else self.__exit__(None, None, None)

    def phase(self, name: str, requests: list, start: bool = True) -> None:
        if not start:
            self.current = "draft"
            return
        stepping = any(r.call.phase == "step" for r in requests) if name != "read" else False
        if name == "target":
            self.in_target = True
            self.target_phases += stepping
        elif name == "draft":
            self.in_target = False
            self.draft_rounds += stepping
        self.current = "verify" if name == "read" and self.in_target else "draft"

    def resume(self, request) -> None:
        self.current = self.sections.get(id(request.state), "draft") if request is not None else "draft"

    def section(self, state, name: str) -> None:
        self.sections[id(state)] = name
        self.current = name

    def forward(self, batcher, start: bool, seconds: float = 0.0) -> None:
        self.paused = start


def count(name: str, sampling, target, draft, tokens: int) -> dict:
    """Reads per target step of strategy `name`, one request driven alone, split into verification
    and drafting (verifications chosen as on a GPU: batched)."""
    strat = make_strategy(name, **OPTIONS.get(name, {}))
    reads = HostReads()
    t_run = ModelRunner.alone(target, 256, hooks=reads)
    d_run = ModelRunner.alone(draft, 256, hooks=reads) if strat.needs_draft else None
    st = DecodeState(t_run, d_run, sampling, np.zeros(256, dtype=np.int64), 0)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    st.append(prompt)
    drive(t_run.prefill(prompt[:-1]))
    if d_run is not None:
        drive(d_run.prefill(prompt[:-1]))
    with reads:
        while st.n_tokens < len(prompt) + tokens:
            st.append(drive(step(st, strat), batched=True))
    steps = len(st.steps)
    per_step = {ph: sum(reads.counts.get(ph, Counter()).values()) / steps for ph in ("verify", "draft")}
    return {"strategy": name, "sampling": "greedy" if sampling.greedy else "sampled", "steps": steps,
            "tokens": st.n_tokens - len(prompt), "verify_reads_per_step": per_step["verify"],
            "draft_reads_per_step": per_step["draft"],
            "draft_reads": dict(reads.counts.get("draft", Counter()).most_common(4))}


def count_batch(name: str, sampling, target, draft, tokens: int, batch: int) -> dict:
    """Reads per target phase (verification: reads made while a request's verify_and_commit runs, and
    the scheduler's joint read of the phase's results) and per draft round (everything else) of
    `batch` requests of strategy `name` run at once, verifications chosen as on a GPU (batched)."""
    strat = make_strategy(name, **OPTIONS.get(name, {}))
    reads = HostReads(scheduled=True)
    gen = Generator(target, draft if strat.needs_draft else None, capacity=256, slots=batch, hooks=reads,
                    batched_verify=True)
    try:
        handles = [gen.submit([1, 2, 3, 4, 1, 2, 3, 4, 1 + i, 2], strategy=strat, sampling=sampling, seed=i,
                              max_new_tokens=tokens) for i in range(batch)]
        for h in handles:
            h.result()
    finally:
        gen.close()
    verify, drafting = reads.counts.get("verify", Counter()), reads.counts.get("draft", Counter())
    phases, rounds = reads.target_phases, reads.draft_rounds
    return {"strategy": name, "sampling": "greedy" if sampling.greedy else "sampled", "batch": batch,
            "target_phases": phases, "verify_reads_per_phase": sum(verify.values()) / max(phases, 1),
            "draft_rounds": rounds, "draft_reads_per_round": sum(drafting.values()) / max(rounds, 1),
            "draft_reads": dict(drafting.most_common(4))}


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--tokens", default=48, type=click.IntRange(1), help="Tokens to generate per strategy.")
@click.option("--batch", default=1, type=click.IntRange(1), show_default=True,
              help="Requests at once per strategy, through the scheduler: verification reads per target phase.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Also write one JSON line per run here.")
def main(tokens: int, batch: int, json_path: str | None) -> None:
    from trtspec.engines.torch_engine import TorchEngine
    from trtspec.export.tiny import tiny_pair, tiny_spec
    from trtspec.runtime.sampling import SamplingParams
    from trtspec.runtime.strategies import STRATEGIES

    target, draft = (TorchEngine(m) for m in tiny_pair(tiny_spec(vocab_size=512), seed=0))
    runs = [(name, sp) for name in STRATEGIES for sp in (SamplingParams(), SamplingParams(temperature=0.8))]
    if batch > 1:
        rows = [count_batch(name, sp, target, draft, tokens, batch) for name, sp in runs]
        click.echo(f"{'strategy':<9} {'sampling':<8} {'batch':>5} {'target phases':>13} {'verify reads/phase':>19}"
                   f" {'draft rounds':>12} {'draft reads/round':>18}  most common in drafting")
        for r in rows:
            click.echo(f"{r['strategy']:<9} {r['sampling']:<8} {r['batch']:>5} {r['target_phases']:>13} "
                       f"{r['verify_reads_per_phase']:>19.2f} {r['draft_rounds']:>12} "
                       f"{r['draft_reads_per_round']:>18.2f}"
                       f"  {r['draft_reads']}")
        _write(json_path, rows)
        return
    rows = [count(name, sp, target, draft, tokens) for name, sp in runs]
    click.echo(f"{'strategy':<9} {'sampling':<8} {'steps':>5} {'verify reads/step':>18} {'draft reads/step':>17}"
               "  most common")
    for r in rows:
        click.echo(f"{r['strategy']:<9} {r['sampling']:<8} {r['steps']:>5} {r['verify_reads_per_step']:>18.2f} "
                   f"{r['draft_reads_per_step']:>17.1f}  {r['draft_reads']}")
    _write(json_path, rows)


def _write(json_path: str | None, rows: list[dict]) -> None:
    if json_path:
        with open(json_path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
