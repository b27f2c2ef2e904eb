"""Benchmark a running `trtspec serve` over HTTP with the official `openai` client.

    trtspec serve --engines ENGINES --max-batch 8 &
    python -m trtspec.tools.bench_serve --url http://127.0.0.1:8000/v1 --dataset humaneval --limit 8 \\
        --max-tokens 64 --concurrency 1,4,8 --strategies ar,staged --output docs/bench/serve-ort

For each strategy and concurrency c, c closed-loop clients stream the dataset's prompts (greedy,
exactly --max-tokens each: `ignore_eos`), each sending its next prompt when its last one ended.
Measured as a client sees it, per run: total tokens/s (all completion tokens / wall time), time to
first token p50 / p95, inter-token latency p50 / p95 (per request: (end - first token) / (tokens - 1),
i.e. time per output token after the first; with speculation, tokens arrive in bursts of a step),
request latency p50 / p95, and whether every answer equals its c = 1 answer. One warm-up wave
(8 tokens) per strategy is excluded. Writes serve.json, serve.md and serve.png to --output.

`--overhead N` instead times N one-token requests, one at a time (JSON, then streamed): what a
request costs besides generating (HTTP, routing, tokenizing, a short prefill and one step); run it
against two servers of the same folder (one process, and `--replicas 1`) for Ray Serve's share.
Writes overhead.json.

`--overload SECONDS` instead runs more clients than the server has slots for SECONDS, with streams,
sampling, n = 2, schemas, stop strings, long prompts and cancellations, checking every answer
against the same request served alone, and samples the server's memory, files and threads (a soak);
`--drain-after` sends it SIGTERM midway. See trtspec/tools/overload.py. Writes overload.json,
overload.md and overload.png; exits 1 if a check failed.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import overload as overload_run
from .bench_concurrency import _pct, closed_loop, plot_by_strategy
from .datasets import load_prompts


def one_request(client, model: str, prompt, strategy: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first = None
    text, tokens = [], 0
    body = {"speculative": {"strategy": strategy}, "ignore_eos": True}
    if prompt.messages is not None:
        stream = client.chat.completions.create(model=model, messages=prompt.messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, extra_body=body,
                                                stream_options={"include_usage": True})
    else:
        stream = client.completions.create(model=model, prompt=prompt.text, max_tokens=max_tokens, temperature=0,
                                           stream=True, stream_options={"include_usage": True}, extra_body=body)
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        piece = chunk.choices[0].delta.content if prompt.messages is not None else chunk.choices[0].text
        if piece:
            if first is None:
                first = time.perf_counter()
            text.append(piece)
    end = time.perf_counter()
    first = first or end
    return {"latency": end - t0, "ttft": first - t0, "itl": (end - first) / max(1, tokens - 1),
            "tokens": tokens, "text": "".join(text)}


def run_wave(client, model: str, prompts, strategy: str, max_tokens: int, concurrency: int) -> dict:
    out, wall = closed_loop(len(prompts), concurrency,
                            lambda i: one_request(client, model, prompts[i], strategy, max_tokens))
    rs = [out[i] for i in range(len(prompts))]
    n = sum(r["tokens"] for r in rs)
    pick = lambda key: [r[key] for r in rs]  # noqa: E731
    return {"strategy": strategy, "concurrency": concurrency, "requests": len(rs), "completion_tokens": n,
            "seconds": wall, "tokens_per_s": n / wall,
            "ttft_p50_s": _pct(pick("ttft"), 50), "ttft_p95_s": _pct(pick("ttft"), 95),
            "itl_p50_s": _pct(pick("itl"), 50), "itl_p95_s": _pct(pick("itl"), 95),
            "latency_p50_s": _pct(pick("latency"), 50), "latency_p95_s": _pct(pick("latency"), 95),
            "texts": [r["text"] for r in rs]}


def bench_serve(url: str, dataset: str, limit: int | None, stride: int, max_tokens: int, levels: list[int],
                strategies: list[str], api_key: str, log=print) -> tuple[list[dict], str]:
    try:
        import openai
    except ImportError:
        raise SystemExit("bench_serve needs the openai client: pip install openai") from None
    client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    prompts = load_prompts(dataset, limit=limit, stride=stride)
    records = []
    for s in strategies:
        run_wave(client, model, prompts, s, min(8, max_tokens), max(levels))      # warm-up
        base = None
        for c in sorted(levels):
            rec = run_wave(client, model, prompts, s, max_tokens, c)
            base = base or rec
            rec["speedup_vs_sequential"] = rec["tokens_per_s"] / base["tokens_per_s"]
            rec["equal_to_sequential"] = sum(a == b for a, b in zip(rec["texts"], base["texts"]))
            log(f"{s} c={c}: {rec['tokens_per_s']:.2f} tok/s, TTFT p50 {rec['ttft_p50_s']:.2f}s, "
                f"ITL p50 {rec['itl_p50_s'] * 1000:.0f} ms, {rec['equal_to_sequential']}/{rec['requests']} = c=1")
            records.append(rec)
    ar = {r["concurrency"]: r["tokens_per_s"] for r in records if r["strategy"] == "ar"}
    for r in records:
        r["vs_ar"] = r["tokens_per_s"] / ar[r["concurrency"]] if r["concurrency"] in ar else None
    return records, model


def overhead(client, model: str, n: int, warmup: int = 10) -> dict:
    """Latency of `n` sequential one-token greedy requests, ms p50 / p95, JSON and streamed."""
    out = {"requests": n}
    for mode in ("json", "stream"):
        lat = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            res = client.completions.create(model=model, prompt="def f(x):", max_tokens=1, temperature=0,
                                            stream=mode == "stream", extra_body={"speculative": {"strategy": "ar"}})
            if mode == "stream":
                list(res)
            if i >= warmup:
                lat.append(time.perf_counter() - t0)
        out[mode] = {"p50_ms": _pct(lat, 50) * 1e3, "p95_ms": _pct(lat, 95) * 1e3, "mean_ms": sum(lat) / n * 1e3}
    return out


def write_report(records: list[dict], output: Path, settings: dict) -> None:
    output.mkdir(parents=True, exist_ok=True)
    (output / "serve.json").write_text(json.dumps({"settings": settings, "runs": records}, indent=1))
    lines = ["| strategy | concurrency | tok/s (all) | × ar | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | "
             "latency p50 / p95 (s) | answers = c=1 |", "|---|---|---|---|---|---|---|---|"]
    for r in records:
        vs = f"{r['vs_ar']:.2f}" if r["vs_ar"] is not None else "–"
        lines.append(f"| {r['strategy']} | {r['concurrency']} | {r['tokens_per_s']:.2f} | {vs} | "
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['itl_p50_s'] * 1e3:.0f} / "
                     f"{r['itl_p95_s'] * 1e3:.0f} | {r['latency_p50_s']:.1f} / {r['latency_p95_s']:.1f} | "
                     f"{r['equal_to_sequential']}/{r['requests']} |")
    (output / "serve.md").write_text("\n".join(lines) + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    plot_by_strategy(axes[0], records, "tokens_per_s", "tokens/s, all requests", "concurrent clients")
    plot_by_strategy(axes[1], records, "itl_p50_s", "inter-token latency p50 (ms)", "concurrent clients", 1e3)
    fig.suptitle(settings.get("title", "trtspec serve"))
    fig.tight_layout()
    fig.savefig(output / "serve.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default="none")
    p.add_argument("--dataset", default="humaneval", help="humaneval | mtbench | FILE.jsonl")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("--strategies", default="ar,staged")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--title", default=None)
    p.add_argument("--overhead", type=int, default=None, metavar="N",
                   help="time N one-token requests one at a time instead (overhead.json)")
    overload_run.add_arguments(p)
    a = p.parse_args(argv)
    if a.overload:
        raise SystemExit(overload_run.main(a))
    if a.overhead:
        import openai
        client = openai.OpenAI(base_url=a.url, api_key=a.api_key, max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        rec = {"url": a.url, "model": model, "date": time.strftime("%Y-%m-%d"), "title": a.title,
               **overhead(client, model, a.overhead)}
        a.output.mkdir(parents=True, exist_ok=True)
        (a.output / "overhead.json").write_text(json.dumps(rec, indent=1))
        print(json.dumps(rec, indent=1))
        return
    levels = [int(x) for x in a.concurrency.split(",")]
    records, model = bench_serve(a.url, a.dataset, a.limit, a.stride, a.max_tokens, levels,
                                 a.strategies.split(","), a.api_key)
    settings = {"url": a.url, "model": model, "dataset": a.dataset, "limit": a.limit, "stride": a.stride,
                "max_tokens": a.max_tokens, "date": time.strftime("%Y-%m-%d"),
                "title": a.title or f"trtspec serve: {model}, {a.dataset} x{a.limit}, {a.max_tokens} tokens"}
    write_report(records, a.output, settings)
    print((a.output / "serve.md").read_text())


if __name__ == "__main__":
    main()
