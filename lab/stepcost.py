"""Step-cost model: how long one forward over T new tokens takes, per engine, on this machine.

Tree budgets should be sized by this curve: a tree of T nodes pays off only if its expected
accepted length beats cost(T) / cost(1) plus the draft's cost.

    python -m lab.stepcost --engines DIR [--role target] [--tokens 1,2,4,8,16,32]
                                     [--cached 256] [--threads 1] [--backend torch] [--profile DIR]

`--profile DIR` (ONNX Runtime) also keeps ORT's profiler trace and prints the time per op type.
`--against DIR` (repeatable) loads the same role of other folders into the same process and times
them interleaved, one forward of each in turn, so that a before/after comparison sees the same
machine state (on a shared or throttled machine, runs minutes apart differ by 10-20%).
"""
from __future__ import annotations

import json

import click
import torch

from trtspec.assembly.backends import NAMES as BACKENDS
from trtspec.options import MAX_STEP_TOKENS
from trtspec.runtime.costs import step_costs


@click.command()
@click.option("--engines", "engines_dir", required=True, type=click.Path(exists=True))
@click.option("--role", type=click.Choice(["target", "draft"]), default="target")
@click.option("--tokens", default="1,2,4,8,16,32", help="Comma-separated step sizes T.")
@click.option("--cached", default=256, type=click.IntRange(0), help="Tokens already in the cache.")
@click.option("--threads", default=1, type=click.IntRange(1))
@click.option("--repeats", default=3, type=click.IntRange(1), help="Timed forwards per T (min and median kept).")
@click.option("--backend", type=click.Choice(BACKENDS), default=None, help="Default: the folder's.")
@click.option("--against", "others", multiple=True, type=click.Path(exists=True),
              help="Another engine folder (repeatable): its forwards are interleaved with the first's.")
@click.option("--profile", "profile_dir", type=click.Path(file_okay=False), default=None,
              help="ONNX Runtime only: run with ORT's profiler, keep its JSON trace in this folder and print "
                   "the time per op type for each T.")
def main(engines_dir, role, tokens, cached, threads, repeats, backend, others, profile_dir):
    """Time one target (or draft) forward over T new tokens after CACHED cached ones."""
    from pathlib import Path

    from trtspec.assembly.load import load_role, open_folder
    from trtspec.errors import TrtspecError
    from trtspec.runtime.runner import ModelRunner
    try:
        sizes = [int(x) for x in tokens.split(",")]
    except ValueError:
        raise click.BadParameter(f"{tokens!r} is not a comma-separated list of integers", param_hint="--tokens")
    if min(sizes) < 1 or max(sizes) > MAX_STEP_TOKENS or len(set(sizes)) != len(sizes):
        raise click.BadParameter(f"step sizes must be distinct, in 1..{MAX_STEP_TOKENS}", param_hint="--tokens")
    torch.set_num_threads(threads)
    asked = backend
    try:
        manifest, cfg, backend = open_folder(engines_dir, backend=backend)
        if role not in manifest["models"]:
            raise click.ClickException(f"{engines_dir} has no draft model; use --role target")
        if profile_dir and backend != "onnxruntime":
            raise click.BadParameter(f"profiles are ONNX Runtime's; this run uses backend {backend}",
                                     param_hint="--profile")
        if cached + max(sizes) > cfg.max_seq_len:
            raise click.BadParameter(f"--cached {cached} + T {max(sizes)} exceeds max_seq_len {cfg.max_seq_len}",
                                     param_hint="--cached")
        prefix = None
        if profile_dir:
            Path(profile_dir).mkdir(parents=True, exist_ok=True)
            prefix = str(Path(profile_dir) / f"{role}")
        engine = load_role(Path(engines_dir), role, manifest, cfg, backend, threads, profile_prefix=prefix)
        if others:
            if profile_dir:
                raise click.BadParameter("profile one folder at a time", param_hint="--against")
            engines = {engines_dir: engine}
            for d in others:
                m, c, b = open_folder(d, backend=asked)
                engines[d] = load_role(Path(d), role, m, c, b, threads)
    except TrtspecError as e:
        raise click.ClickException(str(e)) from None
    if others:
        try:
            for row in interleaved(engines, sizes, cached, repeats, cfg.buckets.model_dump()):
                click.echo(json.dumps({"role": role, "threads": threads, "cached": cached, **row}))
        finally:
            for e in engines.values():
                e.close()
        return
    try:
        runner = ModelRunner.alone(engine, capacity=cached + max(sizes) + 1, buckets=cfg.buckets.model_dump())
        for row in step_costs(runner, sizes, cached, repeats):
            click.echo(json.dumps({"role": role, "backend": backend, "threads": threads, "cached": cached, **row}))
        if profile_dir:
            from .ort_profile import op_times, table
            trace = engine.session.end_profiling()
            click.echo(f"ORT profile: {trace} ({repeats} steps per T; ms per step by op type)")
            click.echo(table(op_times(trace, sizes, repeats)))
    finally:
        engine.close()


def interleaved(engines: dict, sizes: list[int], cached: int, repeats: int, buckets: dict) -> list[dict]:
    """step_costs for several engines at once: per T, `repeats` rounds of one forward each."""
    from trtspec.runtime.costs import cost_row, prefill_for_costs, timed_forward
    from trtspec.runtime.runner import ModelRunner
    runners = {name: ModelRunner.alone(e, capacity=cached + max(sizes) + 1, buckets=buckets)
               for name, e in engines.items()}
    for r in runners.values():
        prefill_for_costs(r, cached)
    rows = []
    for t in sizes:
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(repeats):
            for name, r in runners.items():
                times[name].append(timed_forward(r, t))
        rows += [{"engines": name, **cost_row(t, x)} for name, x in times.items()]
    return rows


if __name__ == "__main__":
    main()
