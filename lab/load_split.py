"""Where a loaded server's time goes, by strategy: the wall time of a wave of concurrent requests split
into target and draft forwards (prefill and steps), the requests' own Python (strategies, budget,
verification), the scheduler's bookkeeping and idle time, with the shapes of the target's forwards.

The same wave as `trtspec bench --concurrency` (tools/bench_concurrency.run_wave: the dataset's prompts,
greedy, exactly --max-new-tokens each, closed-loop clients), observed through the runtime's hooks
(runtime/hooks.py) and the batchers' forward timing; one warm-up wave per strategy is not recorded.
Issue 62 part 5: why the default strategy was slower than `ar` at 4 concurrent requests although
its budget planned no draft.

    python -m lab.load_split --engines FOLDER [--concurrency 4] [--strategies ar,staged] [--json out.json]
"""
from __future__ import annotations

import json
import time
from collections import Counter, defaultdict

import click

from trtspec.runtime.hooks import Hooks


class Split(Hooks):
    """Seconds by what the scheduler's thread was doing: each phase, the requests' coroutines inside it
    (`resume`), the forwards inside it; plus the target forwards' shapes (rows, padded new tokens)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds: Counter = Counter()        # "iteration", "phase:<name>", "python:<phase>"
        self.counts: Counter = Counter()
        self.shapes: Counter = Counter()         # (rows, max new tokens) of each all-step target phase
        self.shape_s: defaultdict = defaultdict(float)
        self._phase, self._shape = "admit", None
        self._t: dict[str, float] = {}

    def iteration(self, start: bool) -> None:
        self._mark("iteration", start)
        if start:
            self.counts["iterations"] += 1

    def phase(self, name: str, requests: list, start: bool = True) -> None:
        self._mark(f"phase:{name}", start)
        self._phase = name if start else "scheduler"
        self._shape = None
        if start and name == "target" and all(r.call.phase == "step" for r in requests):
            self._shape = (len(requests), max(len(r.call.tokens) for r in requests))
            self.shapes[self._shape] += 1

    def resume(self, request) -> None:
        self._mark(f"python:{self._phase}", request is not None)

    def forward(self, batcher, start: bool, seconds: float = 0.0) -> None:
        if not start:
            self.seconds[f"forward:{self._phase}"] += seconds
            if self._shape is not None:
                self.shape_s[self._shape] += seconds

    def _mark(self, key: str, start: bool) -> None:
        now = time.perf_counter()
        if start:
            self._t[key] = now
        elif key in self._t:
            self.seconds[key] += now - self._t.pop(key)


def wave(gen, split: Split, prompts, strategy: str, max_new: int, concurrency: int) -> dict:
    from trtspec.tools.bench import instrument
    from trtspec.tools.bench_concurrency import run_wave
    for b in gen.batchers.values():
        instrument(b)
    split.reset()
    rec = run_wave(gen, prompts, strategy, max_new, concurrency)
    s = split.seconds
    forwards = {role: {ph: {"steps": b.steps[ph], "seconds": b.seconds[ph]} for ph in ("prefill", "step")}
                for role, b in gen.batchers.items()}
    fwd = sum(v["seconds"] for f in forwards.values() for v in f.values())
    python = {k.split(":")[1]: v for k, v in s.items() if k.startswith("python:")}
    phases = {k.split(":")[1]: v for k, v in s.items() if k.startswith("phase:")}
    in_phases = sum(phases.values())
    out = {"strategy": strategy, "concurrency": concurrency, "seconds": rec["seconds"],
           "tokens_per_s": rec["tokens_per_s"], "new_tokens": rec["new_tokens"],
           "iterations": split.counts["iterations"], "forwards": forwards, "forward_s": fwd,
           "python_s": python, "phase_s": phases,
           # the scheduler thread's time outside any forward and any request's coroutine
           "scheduler_s": s["iteration"] - fwd - sum(v for k, v in python.items() if k != "admit"),
           "in_phases_not_forward_or_python_s": in_phases - fwd - sum(v for k, v in python.items()
                                                                     if k in phases),
           "outside_iterations_s": rec["seconds"] - s["iteration"],
           "target_step_shapes": [{"rows": r, "tokens": t, "forwards": n, "ms": 1e3 * split.shape_s[(r, t)] / n}
                                  for (r, t), n in sorted(split.shapes.items())],
           "policy": {k: v for k, v in rec.items() if k.startswith("policy_")},
           "token_ids": rec["token_ids"]}
    return out


def report(rows: list[dict]) -> list[str]:
    lines = ["| strategy | c | tok/s | wall s | iterations | target step fwd (n, s) | target prefill (n, s) | "
             "draft step (n, s) | draft prefill (n, s) | requests' Python s (by phase) | scheduler s | outside s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["forwards"]

        def cell(role: str, ph: str) -> str:
            if role not in f:
                return "–"
            return f"{f[role][ph]['steps']}, {f[role][ph]['seconds']:.2f}"
        py = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["python_s"].items()))
        lines.append(f"| {r['strategy']} | {r['concurrency']} | {r['tokens_per_s']:.2f} | {r['seconds']:.2f} | "
                     f"{r['iterations']} | {cell('target', 'step')} | {cell('target', 'prefill')} | "
                     f"{cell('draft', 'step')} | {cell('draft', 'prefill')} | {py} | {r['scheduler_s']:.2f} | "
                     f"{r['outside_iterations_s']:.2f} |")
    for r in rows:
        shapes = ", ".join(f"{s['rows']}x{s['tokens']}: {s['forwards']} at {s['ms']:.0f} ms"
                           for s in r["target_step_shapes"])
        lines.append(f"\n{r['strategy']} c={r['concurrency']}: target step shapes (rows x new tokens): {shapes}; "
                     f"policy {r['policy']}")
    return lines


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--engines", "folder", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--dataset", default="humaneval", show_default=True)
@click.option("--limit", default=8, show_default=True, type=click.IntRange(1))
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1))
@click.option("--strategies", default="ar,staged", show_default=True)
@click.option("--repeat", default=1, show_default=True, type=click.IntRange(1), help="Measured waves per strategy "
              "(interleaved: ar, staged, ar, staged, ...).")
@click.option("--threads", default=None, type=click.IntRange(0))
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(folder: str, dataset: str, limit: int, max_new_tokens: int, concurrency: int, strategies: str,
         repeat: int, threads: int | None, json_path: str | None) -> None:
    from trtspec.assembly.load import load_generator
    from trtspec.runtime.prompts import encode
    from trtspec.tools.bench import with_first_answers
    from trtspec.tools.bench_concurrency import run_wave
    from trtspec.tools.datasets import load_prompts
    split = Split()
    names = strategies.split(",")
    with load_generator(folder, threads=threads, slots=concurrency, prefix_cache=0, hooks=split) as gen:
        prompts = with_first_answers(gen, load_prompts(dataset, limit, 1), max_new_tokens, set(gen.stop_ids))
        prompts = [encode(p, gen.tokenizer, chat=False) for p in prompts]
        for s in names:                                          # warm-up, not recorded
            run_wave(gen, prompts, s, min(8, max_new_tokens), concurrency)
        rows = [wave(gen, split, prompts, s, max_new_tokens, concurrency) for _ in range(repeat) for s in names]
    first = rows[0]["token_ids"]                                 # the first strategy's first wave
    for r in rows:
        r["equal_to_first"] = sum(a == b for a, b in zip(r.pop("token_ids"), first))
    for line in report(rows):
        click.echo(line)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
