"""`trtspec bench` reports: results.md (Markdown tables) and PNG plots (matplotlib, Agg backend).

    speedup.png        per-prompt speedup over our `ar`, per runner: box plot + the points
    accepted_hist.png  tokens emitted per target step, per strategy (from the per-step stats)
    time_split.png     milliseconds per generated token: draft / verify / prefill / other
"""
from __future__ import annotations

from pathlib import Path


def _f(x, fmt: str = "{:.2f}") -> str:
    return "–" if x is None else fmt.format(x)


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "–"


def aggregate_table(results: dict) -> str:
    """The aggregate Markdown table (also printed by the CLI)."""
    head = ("| runner | tok/s | × ar | × ar per prompt: median [min–max] | × hf | tokens/step | ceiling × ar "
            "| measured / ceiling | draft | verify | prefill | other | in forwards | peak RSS MB | = ar |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, a in results["aggregate"].items():
        pp = a["speedup_vs_ar_per_prompt"]
        spread = f"{_f(pp['median'])} [{_f(pp['min'])}–{_f(pp['max'])}]" if pp["median"] is not None else "–"
        s = a["seconds"]
        lines.append(
            f"| {name} | {a['tokens_per_s']:.1f} | {_f(a['speedup_vs_ar'])} | {spread} | {_f(a['speedup_vs_hf'])} "
            f"| {_f(a['mean_accepted'])} | {_f(a['ceiling'])} | {_f(a['measured_over_ceiling'])} "
            f"| {_pct(a['draft_seconds'], s)} | {_pct(a['verify_seconds'], s)} | {_pct(a['prefill_seconds'], s)} "
            f"| {_pct(a['other_seconds'], s)} | {_pct(a['forward_seconds'], s)} | {_f(a['peak_rss_mb'], '{:.0f}')} "
            f"| {a['prompts_matching_ar']}/{a['prompts']} |")
    return "\n".join(lines)


def per_prompt_table(results: dict) -> str:
    runners = results["settings"]["runners"]
    lines = ["| prompt | prompt tokens | " + " | ".join(runners) + " |", "|---|---|" + "---|" * len(runners)]
    for p in results["prompts"]:
        cells = []
        for name in runners:
            r = p["runs"][name]
            cell = f"{r['tokens_per_s']:.1f} ({_f(r['speedup_vs_ar'])}×)"
            if r["first_divergence"] is not None:
                cell += f" ≠@{r['first_divergence']}"
            cells.append(cell)
        lines.append(f"| {p['id']} | {p['prompt_tokens']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ratio_cells(results: dict, ps: list[dict]) -> list[str]:
    """Per runner over the prompts `ps`: × ar from their totals, and τ (tokens per target step)."""
    runners = results["settings"]["runners"]

    def total(name: str, key: str) -> float:
        return sum(p["runs"][name][key] for p in ps)

    ar_rate = total("ar", "new_tokens") / total("ar", "seconds") if "ar" in runners else None
    cells = []
    for name in runners:
        tau = total(name, "new_tokens") / total(name, "target_steps")
        rate = total(name, "new_tokens") / total(name, "seconds")
        cells.append(f"{rate / ar_rate:.2f}× (τ {tau:.1f})" if ar_rate else f"τ {tau:.1f}")
    return cells


def per_category_table(results: dict) -> str | None:
    """× ar and τ per prompt category (MT-Bench's writing, coding, ...)."""
    cats: dict[str, list[dict]] = {}
    for p in results["prompts"]:
        if "category" in p["meta"]:
            cats.setdefault(p["meta"]["category"], []).append(p)
    if not cats:
        return None
    runners = results["settings"]["runners"]
    lines = ["| category | prompts | " + " | ".join(runners) + " |", "|---|---|" + "---|" * len(runners)]
    lines += [f"| {cat} | {len(ps)} | " + " | ".join(_ratio_cells(results, ps)) + " |" for cat, ps in cats.items()]
    return "\n".join(lines)


def stop_split_table(results: dict) -> str | None:
    """Greedy runs ignore stop tokens so that every runner emits the same count; this table splits the
    prompts by whether ar's output passed a stop token, so the effect of the text generated past it
    is visible. (Sampled runs: every runner draws its own text, no common split.)"""
    stops = set(results["settings"].get("stop_ids_ignored") or [])
    runners = results["settings"]["runners"]
    if results["settings"]["temperature"] != 0 or not stops or "ar" not in runners:
        return None
    groups: dict[str, list[dict]] = {"no stop token within the budget": [], "stop token before the budget": []}
    past = 0
    for p in results["prompts"]:
        ids = p["runs"]["ar"]["token_ids"]
        first = next((i for i, t in enumerate(ids) if t in stops), None)
        groups["no stop token within the budget" if first is None else "stop token before the budget"].append(p)
        past += 0 if first is None else len(ids) - first
    total = sum(len(p["runs"]["ar"]["token_ids"]) for p in results["prompts"])
    lines = [f"{past} of {total} tokens ({100 * past / max(total, 1):.0f}%) come after a stop token.", "",
             "| prompts | n | " + " | ".join(runners) + " |", "|---|---|" + "---|" * len(runners)]
    lines += [f"| {g} | {len(ps)} | " + " | ".join(_ratio_cells(results, ps)) + " |" for g, ps in groups.items() if ps]
    return "\n".join(lines)


def markdown(results: dict) -> str:
    m, s = results["machine"], results["settings"]
    v = m["versions"]
    n = len(results["prompts"])
    hf = s.get("hf") or {}
    lines = [
        f"# trtspec bench: {s['config']} on {s['dataset']}",
        "",
        f"- date {m['date']}; command `{m['command']}`",
        f"- CPU {m['cpu']}, {m['cores']} cores ({m['cores_available']} available), torch threads "
        f"{m['torch_threads']}; load average {' '.join(m.get('loadavg_start') or [])} at start, "
        f"{' '.join(m.get('loadavg_end') or [])} at end",
        f"- trtspec {v.get('trtspec')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
        f"python {m['python']}",
        f"- backend {s['backend']} on {s.get('device', 'cpu')}, target {s['target_dtype']}"
        + (f" quantized {s['target_quantize']}" if s.get("target_quantize") not in (None, "none") else "")
        + f", draft {s['draft_dtype']}"
        + (f" (our draft quantized: {s['draft_quantize']}; HF's assistant is not)"
           if s.get("draft_quantize") not in (None, "none") else "") + f"; {n} prompts"
        + (f" ({len(results['skipped'])} skipped: too long)" if results["skipped"] else "")
        + (f", {s['max_new_tokens']} new tokens each (stop ids ignored, HF eos disabled)"
           if s.get("stop_ids_ignored", True) else f", at most {s['max_new_tokens']} new tokens (answers end at the "
           "model's stop token)") + (f", grammar {s['grammar']['kind']}" if s.get("grammar") else "")
        + f", temperature {s['temperature']}" + (", chat template" if s["chat"] else ""),
        f"- strategy options: {s['strategy_options']}",
    ]
    if hf:
        names = ", ".join(p for p in s["peers"] if p.startswith("hf"))
        lines.append(f"- HF peers: {names}; dtype {hf['dtype']}, attention "
                     f"{hf['attn_implementation']}, assisted: {hf['assisted']}, prompt lookup "
                     f"{hf['prompt_lookup_num_tokens']} tokens"
                     + (" (fp32 weights: HF runs the folder's source, not its quantized graph)"
                        if s.get("target_quantize") not in (None, "none") else ""))
    if llama := s.get("llama.cpp"):
        lines.append(f"- llama.cpp peers ({llama['version']}): the GGUF files themselves, {llama['threads']} "
                     f"threads; speculative: {llama['speculative']}; tok/s: {llama['tokens_per_s']}"
                     + "".join(f"; {k.replace('_', ' ')}: {llama[k]}" for k in ("time_split", "peak_rss")
                               if k in llama))      # runs recorded before these keys existed lack them
    lines += [f"- {s['warmup']}; runners interleaved per prompt in the order {', '.join(s['runners'])}", "",
              "## Aggregate", "", aggregate_table(results), "",
              "tok/s and × ar / × hf from the totals over all prompts (same token counts for all runners). "
              "draft / verify / prefill / other: shares of the wall time from the runtime's stats (HF: forward "
              "hooks; its first target/assistant forward counts as prefill); in forwards: share inside model "
              "forwards (engine.step timed). peak RSS: the whole process "
              "(every loaded model, ours and HF's). = ar: prompts whose output equals our ar's token for "
              "token" + (" (greedy: required of our strategies; HF may differ by rounding)."
                         if s["temperature"] == 0 else " (sampled: different draws, agreement not expected)."),
              ""]
    categories = per_category_table(results)
    if categories:
        lines += ["## Per category: × ar from the category's totals (τ = tokens per target step)", "",
                  categories, ""]
    stop_split = stop_split_table(results)
    if stop_split:
        lines += ["## Text past a stop token: × ar (τ) by whether ar's output reached one", "", stop_split, ""]
    mix = sources_table(results)
    if mix:
        lines += ["## Who drafted: nodes proposed and accepted per drafter", "", mix, ""]
    policy = policy_table(results)
    if policy:
        lines += ["## budget: auto, what the policy chose", "", policy, ""]
    lines += ["## Per prompt: tok/s (× ar), ≠@i = first token that differs from ar", "",
              per_prompt_table(results), "", "## Formulas", ""]
    lines += [f"- `{k}`: {v}" for k, v in results["formulas"].items()]
    lines += ["", "## Plots", "", "![speedup over ar](speedup.png)", "",
              "![tokens per target step](accepted_hist.png)", "", "![time split](time_split.png)", ""]
    if policy:
        lines += ["![budget: auto, chosen budget vs acceptance](policy.png)", ""]
    return "\n".join(lines)


def sources_table(results: dict) -> str | None:
    """Per runner that drafted: each drafter's nodes proposed / accepted, and its share of the accepted
    drafts (draft: the draft model; suffix: suffix tries; review: a cheap chain the draft reviewed)."""
    rows = {n: a["sources"] for n, a in results["aggregate"].items() if a.get("sources")}
    if not rows:
        return None
    names = sorted({src for mix in rows.values() for src in mix})
    lines = ["| runner | " + " | ".join(f"{n}: proposed / accepted (share)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for runner, mix in rows.items():
        total = sum(acc for _, acc in mix.values())
        cells = [f"{mix[n][0]} / {mix[n][1]} ({_pct(mix[n][1], total)})" if n in mix else "–" for n in names]
        lines.append(f"| {runner} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _policy_steps(results: dict, runner: str) -> dict[str, list]:
    cols: dict[str, list] = {}
    for p in results["prompts"]:
        for k, v in (p["runs"][runner].get("policy") or {}).items():
            cols.setdefault(k, []).extend(v)
    return cols


def policy_table(results: dict) -> str | None:
    """Per budget-auto runner: the budgets chosen, ar steps, predicted vs measured gain, and the speedup
    the plan's cost table projects (that table's times for the trees chosen)."""
    runners = [r for r in results["settings"]["runners"] if _policy_steps(results, r)]
    if not runners:
        return None
    plan = results["settings"].get("plan_costs")
    lines = ["| runner | steps | ar steps (not drafted) | budget: mean [p10–p90] | accepted per drafted step | "
             "predicted gain (mean) | measured gain (mean) | projected × ar by the cost table |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runners:
        c = _policy_steps(results, r)
        b = c["budget"]
        drafted = [a for a, d in zip(c["accepted"], c["drafted"]) if d]
        meas = [x for x in c["measured_gain"] if x is not None] if not plan else []   # wall time vs another table
        proj = sum((a + 1) * s for a, s in zip(c["accepted"], c["ar_s"])) / sum(c["modelled_s"])
        q = sorted(b)
        lines.append(f"| {r} | {len(b)} | {len(b) - len(drafted)} | {sum(b) / len(b):.1f} "
                     f"[{q[len(q) // 10]}–{q[(9 * len(q)) // 10]}] | "
                     f"{_f(sum(drafted) / len(drafted) if drafted else None)} | "
                     f"{_f(sum(c['predicted_gain']) / len(b))} | {_f(sum(meas) / len(meas) if meas else None)} | "
                     f"{_f(proj)} |")
    lines += ["", "gain = tokens per second of the step over an ar step's (predicted: expected accepted + 1 over "
              "the cost table's draft + verify time; measured: emitted tokens over the step's wall time, "
              "against the table's ar step; – under --plan-costs, whose table is not this machine's). "
              + (f"**The policy planned with `{plan}`, not with costs measured here: the last column is a "
                 "projection from that table's times and the acceptance measured in this run.**" if plan else
                 "The last column uses the costs measured here (the table the policy planned with).")]
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    runners = results["settings"]["runners"]
    agg = results["aggregate"]
    title = f"{results['settings']['config']} · {Path(results['settings']['dataset']).name}"
    files = []

    # 1. speedup over ar per prompt: box + jittered points
    fig, ax = plt.subplots(figsize=(1.2 * len(runners) + 2, 4))
    data = [[p["runs"][r]["speedup_vs_ar"] for p in results["prompts"]] for r in runners]
    ax.boxplot(data, widths=0.5, showfliers=False)
    ax.set_xticks(range(1, len(runners) + 1), runners)
    rng = np.random.default_rng(0)
    for i, ys in enumerate(data, 1):
        ax.scatter(i + rng.uniform(-0.12, 0.12, len(ys)), ys, s=12, alpha=0.6, zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_ylabel("speedup over trtspec ar (per prompt)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=110)
    plt.close(fig)
    files.append("speedup.png")

    # 2. tokens per target step, per strategy of ours (ar is 1 by construction)
    ours = [r for r in runners if agg[r]["kind"] == "trtspec" and r != "ar"] or ["ar"]
    cols = min(3, len(ours))
    rows = (len(ours) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, name in zip(axes.flat, ours):
        hist = {int(k): c for k, c in agg[name]["tokens_per_step_hist"].items()}
        total = sum(hist.values()) or 1
        ks = sorted(hist)
        ax.bar(ks, [hist[k] / total for k in ks])
        ax.set_title(f"{name}: τ = {_f(agg[name]['mean_accepted'])}")
        ax.set_xlabel("tokens per target step")
        ax.set_ylabel("fraction of steps")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))     # readable up to staged's ~40
    for ax in list(axes.flat)[len(ours):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out / "accepted_hist.png", dpi=110)
    plt.close(fig)
    files.append("accepted_hist.png")

    # 3. time split: ms per generated token
    parts = [("draft_seconds", "draft"), ("verify_seconds", "verify"), ("prefill_seconds", "prefill"),
             ("other_seconds", "other")]
    fig, ax = plt.subplots(figsize=(1.2 * len(runners) + 2, 4))
    bottom = np.zeros(len(runners))
    for key, label in parts:
        vals = np.array([max(agg[r][key], 0.0) * 1e3 / max(agg[r]["new_tokens"], 1) for r in runners])
        ax.bar(runners, vals, bottom=bottom, label=label)
        bottom += vals
    ax.set_ylabel("ms per generated token")
    ax.set_title(title + " · time split")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "time_split.png", dpi=110)
    plt.close(fig)
    files.append("time_split.png")
    return files


def policy_plot(results: dict, out: Path) -> list[str]:
    """policy.png: per prompt, the mean budget chosen against the acceptance it met (accepted drafts per
    drafted step), one point per prompt and budget-auto runner; marker area = share of ar steps."""
    runners = [r for r in results["settings"]["runners"] if _policy_steps(results, r)]
    if not runners:
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in runners:
        xs, ys, ss = [], [], []
        for p in results["prompts"]:
            c = p["runs"][r].get("policy")
            if not c:
                continue
            drafted = [a for a, d in zip(c["accepted"], c["drafted"]) if d]
            xs.append(sum(drafted) / len(drafted) if drafted else 0.0)
            ys.append(sum(c["budget"]) / len(c["budget"]))
            ss.append(20 + 200 * (1 - len(drafted) / len(c["budget"])))
        ax.scatter(xs, ys, s=ss, alpha=0.6, label=r)
    ax.set_xlabel("accepted drafts per drafted step (per prompt)")
    ax.set_ylabel("mean budget chosen (nodes)")
    ax.set_title("budget: auto — tree size follows acceptance (area: share of ar steps)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "policy.png", dpi=110)
    plt.close(fig)
    return ["policy.png"]


def write_report(results: dict, out: Path) -> list[str]:
    """Write results.md and the PNG plots into `out`; return their file names."""
    out = Path(out)
    (out / "results.md").write_text(markdown(results))
    return ["results.md"] + plots(results, out) + policy_plot(results, out)


if __name__ == "__main__":      # re-render a run's report: python -m trtspec.tools.bench_report DIR
    import json
    import sys
    for folder in map(Path, sys.argv[1:] or ["."]):
        print(folder, write_report(json.loads((folder / "results.json").read_text()), folder))
