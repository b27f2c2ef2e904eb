"""How often two engines' greedy outputs agree, from two `trtspec bench` runs on the same prompts.

    python -m lab.agreement out/bench/int4/results.json out/bench/fp32/results.json [--runner ar]

For a quantized target against its fp32 source: a quality note (a quantized target is the target;
lossless means identical to its own `ar`), not a guarantee. Prints, over the prompts both runs hold,
how many outputs are identical, the median first differing position, and the share of all token
positions before the first difference.
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from trtspec.errors import RequestError
from trtspec.tools.bench import _median, first_divergence


def agreement(a: dict, b: dict, runner: str = "ar", runner_b: str | None = None) -> dict:
    runs_b = {p["id"]: p["runs"] for p in b["prompts"]}
    rows = []
    for p in a["prompts"]:
        if p["id"] not in runs_b or runner not in p["runs"] or (runner_b or runner) not in runs_b[p["id"]]:
            continue
        x, y = p["runs"][runner]["token_ids"], runs_b[p["id"]][runner_b or runner]["token_ids"]
        n = min(len(x), len(y))
        first = first_divergence(x[:n], y[:n])
        rows.append({"id": p["id"], "tokens": n, "first_divergence": first})
    total = sum(r["tokens"] for r in rows)
    if not total:
        raise RequestError(f"the two runs share no prompt with outputs of runner {runner}"
                           + (f" / {runner_b}" if runner_b else ""))
    prefix = sum(r["tokens"] if r["first_divergence"] is None else r["first_divergence"] for r in rows)
    return {"prompts": len(rows), "identical": sum(r["first_divergence"] is None for r in rows),
            "median_first_divergence": _median([r["first_divergence"] for r in rows
                                                if r["first_divergence"] is not None]),
            "tokens_before_first_divergence": prefix / total, "per_prompt": rows}


@click.command()
@click.argument("run_a", type=click.Path(exists=True, dir_okay=False))
@click.argument("run_b", type=click.Path(exists=True, dir_okay=False))
@click.option("--runner", default="ar", show_default=True, help="Runner whose outputs are compared.")
@click.option("--runner-b", default=None, help="Runner of RUN_B, if not the same (e.g. llama.cpp).")
def main(run_a, run_b, runner, runner_b):
    """Greedy agreement of RUN_A's and RUN_B's outputs (two bench results.json files)."""
    a, b = (json.loads(Path(p).read_text()) for p in (run_a, run_b))
    try:
        r = agreement(a, b, runner, runner_b)
    except RequestError as e:
        raise click.ClickException(str(e)) from None
    first = r["median_first_divergence"]
    click.echo(f"{r['identical']}/{r['prompts']} outputs identical"
               + (f"; median first difference (of those that differ) at token {first}" if first is not None else "")
               + f"; {r['tokens_before_first_divergence']:.0%} of token positions come before the first difference")
    for row in r["per_prompt"]:
        click.echo(f"  {row['id']}: " + ("identical" if row["first_divergence"] is None
                                         else f"first difference at token {row['first_divergence']}"))


if __name__ == "__main__":
    main()
