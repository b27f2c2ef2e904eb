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


def step_costs(runner, tokens: list[int], cached: int, repeats: int = 3) -> list[dict]:
    runner.reset()
    vocab = runner.engine.spec.vocab_size
    runner.prefill([(1000 + i) % vocab for i in range(cached)])
    runner.extend([1], last_only=False)       # warm-up
    runner.cache.rollback()
    rows = []
    for t in tokens:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.extend([i % vocab for i in range(t)], last_only=False)
            times.append(time.perf_counter() - t0)
            runner.cache.rollback()
        rows.append({"T": t, "min_s": round(min(times), 4), "median_s": round(sorted(times)[len(times) // 2], 4)})
    return rows


@click.command()
@click.option("--engines", "engines_dir", required=True, type=click.Path(exists=True))
@click.option("--role", type=click.Choice(["target", "draft"]), default="target")
@click.option("--tokens", default="1,2,4,8,16,32", help="Comma-separated step sizes T.")
@click.option("--cached", default=256, type=int, help="Tokens already in the cache.")
@click.option("--threads", default=1, type=int)
@click.option("--backend", default=None)
def main(engines_dir, role, tokens, cached, threads, backend):
    from ..engines.load import load_generator
    torch.set_num_threads(threads)
    gen = load_generator(engines_dir, backend=backend, threads=threads)
    runner = gen.target if role == "target" else gen.draft
    for row in step_costs(runner, [int(x) for x in tokens.split(",")], cached):
        click.echo(json.dumps({"role": role, "threads": threads, **row}))


if __name__ == "__main__":
    main()
