"""`trtspec bench --shared-prefix TOKENS`: time to first token with a shared prompt prefix, prefix
cache cold and warm.

Each of the dataset's prompts is asked after the same block of at least TOKENS tokens (a few-shot
block made of the dataset's prompts, last first, as a system message with --chat or MT-Bench, else
prepended as text). Per prompt, with the default strategy and greedy decoding:

- warm: the stores are cleared, the previous prompt's request (untimed) stores the shared block,
  then this prompt's request is timed: only its own question is prefilled;
- cold: the stores are cleared and the same request is timed again: the whole prompt is prefilled.

TTFT = submit to the first emitted token (prefill + the first step). The two outputs must be equal
token for token (checked: a warm start is exact). Written to OUTPUT/prefix.json and prefix.md.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..errors import RequestError
from ..runtime.prompts import Prompt, encode


def shared_block(prompts: list[Prompt], tokenizer, tokens: int) -> str:
    """At least `tokens` tokens of the prompts' own text, whole prompts (cycled if they are too few),
    for a few-shot block."""
    texts = [p.text if p.text is not None else " ".join(m["content"] for m in p.messages) for p in prompts]
    sizes = [len(tokenizer(t)["input_ids"]) for t in texts]
    if not sum(sizes):
        raise RequestError("the dataset's prompts are empty: no shared block can be made of them")
    parts, n = [], 0
    while n < tokens:
        parts.append(texts[len(parts) % len(texts)])
        n += sizes[(len(parts) - 1) % len(texts)]
    return "Examples of earlier requests:\n\n" + "\n\n".join(parts)


def with_prefix(block: str, p: Prompt, chat: bool) -> Prompt:
    if chat or p.messages is not None:
        user = p.messages if p.messages is not None else [{"role": "user", "content": p.text}]
        return Prompt(p.id, messages=[{"role": "system", "content": block}] + user)
    return Prompt(p.id, text=block + "\n\n" + p.text)


def ttft(gen, ids: list[int], strategy: str, max_new_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first emitted token, output, prompt tokens loaded instead of prefilled)."""
    t0 = time.perf_counter()
    handle = gen.submit(ids, strategy=strategy, max_new_tokens=max_new_tokens)
    first = None
    for _ in handle:
        if first is None:
            first = time.perf_counter() - t0
    res = handle.result()
    return first, res.token_ids, res.stats["cached_prompt_tokens"]


def prefix_bench(gen, prompts: list[Prompt], tokens: int, strategy: str, max_new_tokens: int, chat: bool,
                 log: Callable[[str], None] = print) -> list[dict]:
    if not gen.stores:
        raise RequestError("the prefix cache is off (prefix_cache: 0 in the config); nothing to measure")
    block = shared_block(prompts[::-1], gen.tokenizer, tokens)
    encoded = [encode(with_prefix(block, p, chat), gen.tokenizer, chat=chat) for p in prompts]
    records = []
    for i, ids in enumerate(encoded):
        warmer = encoded[i - 1]
        shared = next((k for k, (a, b) in enumerate(zip(ids, warmer)) if a != b), min(len(ids), len(warmer)))
        for store in gen.stores.values():
            store.clear()
        gen.generate(warmer, strategy=strategy, max_new_tokens=1)
        warm_s, warm_out, cached = ttft(gen, ids, strategy, max_new_tokens)
        for store in gen.stores.values():
            store.clear()
        cold_s, cold_out, _ = ttft(gen, ids, strategy, max_new_tokens)
        rec = {"id": prompts[i].id, "prompt_tokens": len(ids), "shared_tokens": shared, "cached_tokens": cached,
               "ttft_cold_s": cold_s, "ttft_warm_s": warm_s, "ratio": warm_s / cold_s, "equal": warm_out == cold_out}
        records.append(rec)
        log(f"{rec['id']}: {len(ids)} tokens ({cached} cached): TTFT cold {cold_s:.2f} s, warm {warm_s:.2f} s "
            f"({rec['ratio']:.2f}x), outputs {'equal' if rec['equal'] else 'DIFFER'}")
    return records


def write_prefix_report(records: list[dict], out: Path, settings: dict) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    cold = [r["ttft_cold_s"] for r in records]
    warm = [r["ttft_warm_s"] for r in records]
    ratio = [r["ratio"] for r in records]
    summary = {"prompts": len(records), "ttft_cold_p50_s": float(np.median(cold)),
               "ttft_warm_p50_s": float(np.median(warm)), "ratio_p50": float(np.median(ratio)),
               "ratio_max": float(max(ratio)), "all_equal": all(r["equal"] for r in records),
               "mean_cached_tokens": float(np.mean([r["cached_tokens"] for r in records])),
               "mean_prompt_tokens": float(np.mean([r["prompt_tokens"] for r in records]))}
    tmp = out / "prefix.json.tmp"
    tmp.write_text(json.dumps({"settings": settings, "summary": summary, "records": records}, indent=1))
    tmp.replace(out / "prefix.json")
    lines = [f"# {settings['title']}", "",
             (f"{summary['prompts']} prompts of {summary['mean_prompt_tokens']:.0f} tokens on average, "
              f"{summary['mean_cached_tokens']:.0f} of them loaded from the prefix cache when warm; strategy "
              f"{settings['strategy']}, greedy, {settings['max_new_tokens']} new tokens."), "",
             "| | TTFT p50 (s) |", "|---|---|",
             f"| cold (prefix cache empty) | {summary['ttft_cold_p50_s']:.3f} |",
             f"| warm (shared block stored by the previous request) | {summary['ttft_warm_p50_s']:.3f} |",
             f"| warm / cold | {summary['ratio_p50']:.3f} (worst {summary['ratio_max']:.3f}) |", "",
             (f"Outputs warm = cold: {'all' if summary['all_equal'] else 'NOT all'} "
              f"{summary['prompts']} prompts.")]
    (out / "prefix.md").write_text("\n".join(lines) + "\n")
    return ["prefix.json", "prefix.md"]
