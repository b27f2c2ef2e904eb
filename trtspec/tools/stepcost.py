"""Step-cost model: how long one forward over T new tokens takes, per engine, on this machine.

Tree budgets should be sized by this curve: a tree of T nodes pays off only if its expected
accepted length beats cost(T) / cost(1) plus the draft's cost.

    python -m trtspec.tools.stepcost --engines DIR [--role target] [--tokens 1,2,4,8,16,32]
                                     [--cached 256] [--threads 1] [--backend torch]
"""
from __future__ import annotations

import json
import time

import click
import torch

from ..config import BACKENDS
from ..options import MAX_STEP_TOKENS
from ..runtime.runner import drive


def step_costs(runner, tokens: list[int], cached: int, repeats: int = 3) -> list[dict]:
    runner.reset()
    vocab = runner.engine.spec.vocab_size
    drive(runner.prefill([(1000 + i) % vocab for i in range(cached)]))
    drive(runner.extend([1], last_only=False))       # warm-up
    runner.cache.rollback()
    rows = []
    for t in tokens:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            drive(runner.extend([i % vocab for i in range(t)], last_only=False))
            times.append(time.perf_counter() - t0)
            runner.cache.rollback()
        rows.append({"T": t, "min_s": round(min(times), 4), "median_s": round(sorted(times)[len(times) // 2], 4)})
    return rows


@click.command()
@click.option("--engines", "engines_dir", required=True, type=click.Path(exists=True))
@click.option("--role", type=click.Choice(["target", "draft"]), default="target")
@click.option("--tokens", default="1,2,4,8,16,32", help="Comma-separated step sizes T.")
@click.option("--cached", default=256, type=click.IntRange(0), help="Tokens already in the cache.")
@click.option("--threads", default=1, type=click.IntRange(1))
@click.option("--backend", type=click.Choice(BACKENDS), default=None, help="Default: the folder's.")
def main(engines_dir, role, tokens, cached, threads, backend):
    """Time one target (or draft) forward over T new tokens after CACHED cached ones."""
    from ..engines.load import load_generator
    from ..errors import TrtspecError
    try:
        sizes = [int(x) for x in tokens.split(",")]
    except ValueError:
        raise click.BadParameter(f"{tokens!r} is not a comma-separated list of integers", param_hint="--tokens")
    if min(sizes) < 1 or max(sizes) > MAX_STEP_TOKENS:
        raise click.BadParameter(f"step sizes must be in 1..{MAX_STEP_TOKENS}", param_hint="--tokens")
    torch.set_num_threads(threads)
    try:
        gen = load_generator(engines_dir, backend=backend, threads=threads, slots=1)
    except TrtspecError as e:
        raise click.ClickException(str(e)) from None
    slot = gen.slots[0]                       # the generator is idle: its first slot is free
    runner = slot.target if role == "target" else slot.draft
    if runner is None:
        raise click.ClickException(f"{engines_dir} has no draft model; use --role target")
    if cached + max(sizes) > runner.cache.capacity:
        raise click.BadParameter(f"--cached {cached} + T {max(sizes)} exceeds the KV capacity "
                                 f"{runner.cache.capacity}", param_hint="--cached")
    for row in step_costs(runner, sizes, cached):
        click.echo(json.dumps({"role": role, "threads": threads, **row}))


if __name__ == "__main__":
    main()
