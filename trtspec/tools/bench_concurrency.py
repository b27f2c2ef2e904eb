"""`trtspec bench --concurrency 1,2,4,8`: throughput and latency with many requests at once.

For each strategy and each concurrency c, the same requests (the dataset's prompts, greedy,
exactly --max-new-tokens each: stop ids are cleared) go through one Generator with c client threads,
each submitting its next prompt as soon as its last one finished (a closed loop, as a serving
benchmark's "max concurrency"). c = 1 is the requests run one after another. Measured per run:

- total tokens/s = all new tokens / wall time from the first submit to the last completion;
- per-request latency (submit -> last token) p50 / p95, and time to first token p50 / p95;
- mean engine batch size of the target (rows per target forward) and target forwards;
- greedy outputs: every request's tokens must equal its c = 1 output (batch invariance, checked);
- × ar: its tokens/s over `ar`'s at the same concurrency (the wall-clock gain; with budget: auto it
  stands beside the gain the policy predicted).

One warm-up wave at the largest concurrency (all prompts, 8 tokens) is excluded. The Generator has
max(c) slots. Written to OUTPUT/concurrency.json, concurrency.md and concurrency.png.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import RequestError
from ..runtime.drafters.suffix import forget as forget_history


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


def closed_loop(count: int, concurrency: int, one: Callable[[int], dict]) -> tuple[dict[int, dict], float]:
    """one(i) for every i < count, by `concurrency` clients that each start their next item when their
    last one ended. Returns (results by i, wall seconds)."""
    lock = threading.Lock()
    todo = list(range(count))
    out: dict[int, dict] = {}

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop(0)
            out[i] = one(i)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def run_wave(gen, prompts: list[list[int]], strategy: str, max_new: int, concurrency: int) -> dict:
    """All prompts through `gen` with `concurrency` closed-loop clients; one record. Every wave starts
    with no learned history (suffix's global tries): the waves run the same prompts."""
    forget_history()
    batcher = gen.batchers["target"]
    f0, r0 = batcher.forwards, batcher.rows

    def one(i: int) -> dict:
        t0 = time.perf_counter()
        h = gen.submit(prompts[i], strategy=strategy, max_new_tokens=max_new, ignore_eos=True)   # exactly max_new
        first = None
        for _ in h:
            if first is None:
                first = time.perf_counter() - t0
        res = h.result()
        pol = [st.extra for st in res.steps if "budget" in st.extra]      # budget: auto's records
        return {"latency": time.perf_counter() - t0, "ttft": first, "tokens": res.token_ids,
                "steps": res.stats["target_steps"], "policy": pol}

    out, wall = closed_loop(len(prompts), concurrency, one)
    n_tok = sum(len(r["tokens"]) for r in out.values())
    lat = [r["latency"] for r in out.values()]
    ttft = [r["ttft"] for r in out.values() if r["ttft"] is not None]
    forwards, rows = batcher.forwards - f0, batcher.rows - r0
    return {"strategy": strategy, "concurrency": concurrency, "requests": len(prompts), "new_tokens": n_tok,
            "seconds": wall, "tokens_per_s": n_tok / wall,
            "latency_p50_s": _pct(lat, 50), "latency_p95_s": _pct(lat, 95),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p95_s": _pct(ttft, 95),
            "target_forwards": forwards, "mean_batch_rows": rows / forwards if forwards else 0.0,
            "tokens_per_request_step": n_tok / max(1, sum(r["steps"] for r in out.values())),
            **policy_summary([p for r in out.values() for p in r["policy"]]),
            "token_ids": [out[i]["tokens"] for i in range(len(prompts))]}


def policy_summary(recs: list[dict]) -> dict:
    """budget: auto over a wave's steps: share of ar steps, mean budget, mean predicted / measured gain."""
    if not recs:
        return {}
    meas = [r["measured_gain"] for r in recs if r["measured_gain"] is not None]
    return {"policy_steps": len(recs), "policy_ar_share": sum(not r["drafted"] for r in recs) / len(recs),
            "policy_mean_budget": sum(r["budget"] for r in recs) / len(recs),
            "policy_predicted_gain": sum(r["predicted_gain"] for r in recs) / len(recs),
            "policy_measured_gain": sum(meas) / len(meas) if meas else None}


def concurrency_bench(gen, prompts: list[list[int]], strategies: list[str], levels: list[int], max_new: int,
                      log: Callable[[str], None] = print) -> list[dict]:
    if max(levels) > len(gen.slots):
        raise RequestError(f"concurrency {max(levels)} needs that many KV slots; the generator has "
                           f"{len(gen.slots)} (set slots in the config)")
    for s in strategies:                                     # warm-up, not recorded
        run_wave(gen, prompts, s, min(8, max_new), max(levels))
    records, ar = [], {}
    for s in strategies:
        base = None
        for c in sorted(levels):
            rec = run_wave(gen, prompts, s, max_new, c)
            if base is None:
                base = rec
            if s == "ar":
                ar[c] = rec
            rec["speedup_vs_sequential"] = rec["tokens_per_s"] / base["tokens_per_s"]
            rec["vs_ar"] = rec["tokens_per_s"] / ar[c]["tokens_per_s"] if c in ar else None
            rec["equal_to_sequential"] = sum(a == b for a, b in zip(rec["token_ids"], base["token_ids"]))
            vs_ar = f", {rec['vs_ar']:.2f}x ar" if s != "ar" and rec["vs_ar"] is not None else ""
            log(f"{s} c={c}: {rec['tokens_per_s']:.2f} tok/s ({rec['speedup_vs_sequential']:.2f}x sequential{vs_ar}), "
                f"latency p50 {rec['latency_p50_s']:.1f}s p95 {rec['latency_p95_s']:.1f}s, "
                f"{rec['mean_batch_rows']:.2f} rows per target forward, "
                f"{rec['equal_to_sequential']}/{len(prompts)} outputs = sequential")
            records.append(rec)
    return records


def write_concurrency_report(records: list[dict], output: Path, settings: dict) -> list[str]:
    output.mkdir(parents=True, exist_ok=True)
    (output / "concurrency.json").write_text(json.dumps({"settings": settings, "runs": records}, indent=1))
    lines = ["| strategy | concurrency | tok/s (all requests) | × sequential | × ar | latency p50 / p95 (s) | "
             "TTFT p50 / p95 (s) | rows per target forward | outputs = sequential |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['strategy']} | {r['concurrency']} | {r['tokens_per_s']:.2f} | "
                     f"{r['speedup_vs_sequential']:.2f} | {_ratio(r.get('vs_ar'))} | "
                     f"{r['latency_p50_s']:.1f} / {r['latency_p95_s']:.1f} | "
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f} | {r['mean_batch_rows']:.2f} | "
                     f"{r['equal_to_sequential']}/{r['requests']} |")
    auto = [r for r in records if "policy_steps" in r]
    if auto:
        lines += ["", "budget: auto, what the policy chose (gain over the batch's ar step). Predicted: by the cost "
                  "table; × ar: measured, tok/s over ar's at the same concurrency; step gain: each step's ar time by "
                  "the table over its measured time (it also shows the table's error).", "",
                  "| strategy | concurrency | steps | ar steps | mean budget | predicted gain | × ar | step gain |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in auto:
            lines.append(f"| {r['strategy']} | {r['concurrency']} | {r['policy_steps']} | "
                         f"{r['policy_ar_share']:.0%} | {r['policy_mean_budget']:.1f} | {r['policy_predicted_gain']:.2f} | "
                         f"{_ratio(r.get('vs_ar'))} | {_ratio(r['policy_measured_gain'])} |")
    (output / "concurrency.md").write_text("\n".join(lines) + "\n")
    files = ["concurrency.json", "concurrency.md"]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        plot_by_strategy(ax, records, "tokens_per_s", "tokens/s, all requests", "concurrent requests")
        ax.set_title(settings.get("title", "throughput vs concurrency"))
        fig.tight_layout()
        fig.savefig(output / "concurrency.png", dpi=120)
        plt.close(fig)
        files.append("concurrency.png")
    except ImportError:
        pass
    return files


def _ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def plot_by_strategy(ax, records: list[dict], key: str, ylabel: str, xlabel: str, scale: float = 1.0) -> None:
    """One line per strategy: records[key] * scale against concurrency (log2 axis)."""
    for s in dict.fromkeys(r["strategy"] for r in records):
        rs = [r for r in records if r["strategy"] == s]
        ax.plot([r["concurrency"] for r in rs], [r[key] * scale for r in rs], marker="o", label=s)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend()
