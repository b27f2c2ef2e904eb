"""Prefill rate: tokens/s of an engine folder's target over a prompt of N tokens (issue 62, part 4).

    python -m lab.prefill_rate --engines DIR [--tokens 1024,4096] [--repeats 2] [--threads 2]

Each run is the product's own prefill (`Generator.generate`, strategy `ar`, one new token: the
runtime's chunks of PREFILL_CHUNK tokens), with the prefix cache off so no run reuses another's
rows; the prompt is Python source text from the standard library, tokenized by the folder's
tokenizer. Prints one JSON line per length (best of the repeats). Compare with llama.cpp's
`llama-bench -p 1024,4096 -n 0 -t 2` on the same GGUF, in the same run.
"""
from __future__ import annotations

import inspect
import json
import time

import click


@click.command()
@click.option("--engines", "engines_dir", required=True, type=click.Path(exists=True))
@click.option("--tokens", default="1024,4096", help="Comma-separated prompt lengths.")
@click.option("--repeats", default=2, type=click.IntRange(1))
@click.option("--threads", default=2, type=click.IntRange(1))
def main(engines_dir: str, tokens: str, repeats: int, threads: int) -> None:
    from trtspec.assembly.load import load_generator

    gen = load_generator(engines_dir, threads=threads, prefix_cache=0)
    try:
        text = "".join(open(inspect.getsourcefile(m)).read() for m in (json.decoder, inspect, click.core))
        ids = gen.tokenizer.encode(text)
        for n in (int(x) for x in tokens.split(",")):
            if n > len(ids):
                raise click.BadParameter(f"{n} tokens asked, the text has {len(ids)}", param_hint="--tokens")
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                gen.generate(ids[:n], max_new_tokens=1, strategy="ar")
                best = min(best, time.perf_counter() - t0)
            print(json.dumps({"engines": engines_dir, "prompt_tokens": n, "threads": threads,
                              "best_s": round(best, 3), "tokens_per_s": round(n / best, 1)}), flush=True)
    finally:
        gen.close()


if __name__ == "__main__":
    main()
