"""device_check.json -> device_check.md: the tables a reader wants, and the issue's goals judged
from the measured numbers (never from anything else)."""
from __future__ import annotations


def markdown(res: dict) -> str:
    out = [f"# trtspec device check — {res.get('started', '')}", "",
           f"Command: `{res.get('command', '')}`; mode: {'tiny (CPU smoke)' if res.get('tiny') else 'full'}; "
           f"{res.get('seconds', 0):.0f} s in all.", ""]
    for name, sec in res.get("sections", {}).items():
        head = f"## {name} ({sec.get('seconds', 0):.0f} s)"
        if "error" in sec:
            out += [head, "", f"FAILED: {sec['error']}", ""]
        elif "skipped" in sec:
            out += [head, "", f"skipped: {sec['skipped']}", ""]
        else:
            out += [head, ""] + SECTIONS[name](sec["result"], res) + [""]
    return "\n".join(out)


def _machine(m: dict, _res) -> list[str]:
    rows = [("device", m.get("gpu") or m.get("cpu")), ("memory (GiB)", m.get("gpu_memory_gib")),
            ("driver", m.get("driver")), ("torch / CUDA", f"{m['torch']} / {m.get('cuda')}"),
            ("python", m["python"]), ("copy bandwidth (read + write)", f"{m['copy_gb_per_s']} GB/s"),
            (f"matmul {m['matmul']}", f"{m['matmul_tflop_per_s']} TFLOP/s")]
    return ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows if v is not None]


def _exact(e: dict, _res) -> list[str]:
    out = [f"Token bucket {e['token_bucket']}; trees at cached lengths 16-{_longest(e)}; settings: plain (shapes as they come), fixed (one padded "
           "step shape, the whole KV buffer, no reduced-precision reductions or split-K), fixed-fp64 (and "
           "fp64 attention), logical (fixed's shape, attention in the model's dtype by logical order over the "
           "KV pool in place: engines/logical_engine.py); `+graphs`: the same as CUDA graphs.", "",
           *_run_header("arch")]
    for arch, runs in e["archs"].items():
        out += [_run_row(arch, name, r) for name, r in runs.items() if name != "model"]
    if c := e.get("chi_square"):
        out += ["", f"Sampled `staged` (fixed): first token over {c['samples']} samples vs the target's "
                f"distribution, chi-square p = {c['p_value']:.3g} — {'passes' if c['passes'] else 'FAILS'} (p > 0.001)."]
    if h := e.get("head"):
        out += ["", "Hidden rows and a Medusa head role (llama, fixed-fp64; the head: zero blocks under the "
                "target's LM head, so after a step it names the root):", "",
                "| run | medusa strategies ≠ ar | 4 at once ≠ ar | the head named the root |", "|---|---|---|---|"]
        out += [f"| {name} | {len(r['strategies_differ'])} of {r['checked']} | {r['batch4_differ']} of 4 | "
                f"{r['root_named']} steps |" for name, r in h.items()]
    return out


def _run_header(first: str) -> list[str]:
    """The columns of _run_row's table."""
    return [f"| {first} | setting | trees run: nodes differing / nodes | strategies ≠ ar | batch B=1/2/4/8 "
            "mismatches | sampled, 8 at once ≠ alone | rows in a batch ≠ alone: target; draft (; draft, fixed "
            "rows) | graphs = eager | s |", "|---|---|---|---|---|---|---|---|---|"]


def _run_row(arch: str, name: str, r: dict) -> str:
    """One exactness run (exact.py `check`) as a row of the `exact` table."""
    if "skipped" in r or "trees" not in r:
        return f"| {arch} | {name} | {r.get('skipped', r.get('error', '?'))} | | | | | | |"
    t = r["trees"]
    s = r.get("strategies", {})
    batch = "/".join(str(v) for v in r.get("batch", {}).values())
    sb, fd = r.get("sampled_batch", {}), r.get("sampled_batch_fixed_draft")
    sampled = f"{sb['differ']} of {sb['requests']}" if sb else ""
    sampled += f" ({fd['differ']} with a fixed-row draft)" if fd else ""
    return (f"| {arch} | {name} | {t.get('run', '?')}: {t['differ']} / {t['nodes']} "
            f"(max Δ {t['max_abs_diff']:.3g}) | "
            f"{len(s.get('differ', []))} of {s.get('checked', 0) * s.get('prompts', 0)} | {batch} | "
            f"{sampled} | {_rows(r.get('batch_rows'))} | {r.get('graphs_equal_eager', '')} | {r.get('seconds', '')} |")


def _real(e: dict, _res) -> list[str]:
    m = e["model"]
    out = [f"{m['file']} ({m['arch']}, {m['layers']} layers, hidden {m['hidden']}, vocab {m['vocab']}), {m['dtype']}, "
           f"read by trtspec's GGUF loader in {m['load_s']} s; its own draft; random token prompts.", "",
           *_run_header("model")]
    return out + [_run_row(m["arch"], name, r) for name, r in e["runs"].items()]


def _rows(rows: dict | None) -> str:
    """B=2/4/8 calls whose rows differ from alone, per role: "0/1/3 of 4/8/16; 0/0/2 of 4/8/16"."""
    if not rows:
        return ""
    return "; ".join("/".join(str(d) for d, _ in r.values()) + " of " + "/".join(str(n) for _, n in r.values())
                     + ("" if role in ("target", "draft") else f" ({role})") for role, r in rows.items())


def _longest(e: dict):
    return next((r["trees"]["longest"] for runs in e["archs"].values() for r in runs.values()
                 if isinstance(r, dict) and "trees" in r), "?")


def _costs(c: dict, res: dict) -> list[str]:
    out = ["| model | B | C | T | eager ms | graph ms | eager / graph |", "|---|---|---|---|---|---|---|"]
    for r in c["rows"]:
        if "skipped" in r:
            continue
        g = r.get("graph_ms")
        graph, ratio = ("", "") if g is None else (f"{g:.3f}", f"{r['eager_ms'] / g:.2f}")
        out.append(f"| {r['role']} | {r['B']} | {r['C']} | {r['T']} | {r['eager_ms']:.3f} | {graph} | {ratio} |")
    skipped = sum("skipped" in r for r in c["rows"])
    if skipped:
        out.append(f"\n{skipped} shapes skipped: out of time.")
    out += ["", "Goals (target, B = 1):"] + [f"- {line}" for line in goals(c, res)]
    out += ["", "The curve as a cost table: `device_costs.json` beside this report. The projection (these "
            "costs met by the Qwen pair's real acceptance, planned by `budget: auto`; a projection, not a "
            "measurement): `trtspec bench --config qwen2.5-coder-1.5b --plan-costs device_costs.json "
            "--dataset humaneval --limit 10 --max-new-tokens 128 --strategies staged --peers none`."]
    return out


def goals(c: dict, res: dict) -> list[str]:
    rows = {(r["role"], r["B"], r["C"], r["T"]): r for r in c["rows"] if "skipped" not in r}
    lines = []
    one = [r for (role, b, _, t), r in rows.items() if role == "target" and b == 1 and t == 1]
    if one and all("graph_ms" in r for r in one):
        ratio = min(r["eager_ms"] / r["graph_ms"] for r in one)
        lines.append(f"CUDA graphs vs eager at T = 1: {ratio:.2f}x at worst over cached lengths (goal ≥ 1.5x)")
    cs = sorted({k[2] for k in rows})
    mid = 4096 if 4096 in cs else (cs[len(cs) // 2] if cs else None)
    t16, t1 = rows.get(("target", 1, mid, 16)), rows.get(("target", 1, mid, 1))
    if t16 and t1:
        key = "graph_ms" if "graph_ms" in t16 and "graph_ms" in t1 else "eager_ms"
        lines.append(f"a 16-node tree vs one token at {mid} cached ({key[:-3]}): {t16[key] / t1[key]:.2f}x (goal ≤ 1.3x)")
    m = res.get("sections", {}).get("machine", {}).get("result")
    if m and t1:
        floor_ms = 1e3 * c["models"]["target"]["weight_bytes"] / (m["copy_gb_per_s"] * 1e9)
        best = min(t1.get("graph_ms", t1["eager_ms"]), t1["eager_ms"])
        lines.append(f"one-token step {best:.3f} ms vs the weight-read floor {floor_ms:.3f} ms "
                     f"(weights over the copy bandwidth): {best / floor_ms:.2f}x (goal ≤ 1.5x)")
    e2e = res.get("sections", {}).get("e2e", {}).get("result")
    if e2e:
        ar = [r for r in e2e["runs"] if r["strategy"] == "ar" and "skipped" not in r]
        for r in ar:
            lines.append(f"time outside the forwards, `ar` {r['setting']}{' + graphs' if r['graphs'] else ''}: "
                         f"{100 * r['outside_share']:.1f}% of a step (goal ≤ 10%)")
    return lines or ["not enough shapes measured to judge"]


def _settings(r: dict, _res) -> list[str]:
    rows = [x for x in r["rows"] if "skipped" not in x]
    plain = {(x["B"], x["C"]): x["ms"] for x in rows if x["setting"] == "plain"}
    out = [f"A decode step of the 8B-shaped target per setting (fixed ones: the {r['token_bucket']}-token bucket, "
           "every row's logits, the slot's whole buffer), as a CUDA graph where captured:", "",
           "| setting | B | C cached | T | ms | × plain |", "|---|---|---|---|---|---|"]
    for x in rows:
        base = plain.get((x["B"], x["C"]))
        ratio = f"{x['ms'] / base:.2f}" if base else ""
        out.append(f"| {x['setting']}{'' if x['graphs'] else ' (eager)'} | {x['B']} | {x['C']} | {x['T']} | "
                   f"{x['ms']} | {ratio} |")
    for x in r["rows"]:
        if "skipped" in x:
            out.append(f"\n{x['setting']}" + (f" B = {x['B']}, C = {x['C']}" if "B" in x else "") + f": skipped, {x['skipped']}.")
    return out


def _profile(p: dict, res: dict) -> list[str]:
    out = []
    m = res.get("sections", {}).get("machine", {}).get("result")
    if m:
        out += [f"The target's weights' read floor: {1e3 * p['weight_bytes'] / (m['copy_gb_per_s'] * 1e9):.3f} ms "
                f"({p['layers']} layers).", ""]
    for s in p["shapes"]:
        shape = ", ".join(f"{k} = {v}" for k, v in s["shape"].items())
        if "skipped" in s:
            out += [f"{shape}: skipped, {s['skipped']}.", ""]
            continue
        out += [f"**{shape}**:", "", "| step | ms | kernels (per layer) | kernel ms | matmul: kernels, ms | "
                "attention: kernels, ms | the rest: kernels, ms |", "|---|---|---|---|---|---|---|"]
        for name, r in (("the Decoder's", s), ("fused blocks (reference.py)", s.get("reference")),
                        (f"the logical engine's, {s.get('logical', {}).get('rows')} rows", s.get("logical"))):
            if r and "skipped" not in r:
                g = r["groups"]
                out.append(f"| {name}{' (graph)' if r['graphs'] else ' (eager)'} | {r['step_ms']} | "
                           f"{r['kernels_per_step']} ({r['kernels_per_layer']}) | {r['kernel_ms_per_step']} | "
                           + " | ".join(f"{g[k]['kernels']}, {g[k]['ms']}" for k in ("matmul", "attention", "other"))
                           + " |")
        out += ["", "| the Decoder's costliest kernels | per step | ms per step |", "|---|---|---|"]
        out += [f"| `{k['name']}` | {k['per_step']} | {k['ms']} |" for k in s["top"]] + [""]
    return out


def _e2e(e: dict, _res) -> list[str]:
    out = [f"{e['new_tokens']} new tokens after a {e['prompt_tokens']}-token prompt; the draft is the target "
           "itself (its weights at the plain setting beside a fixed-fp64 target), its rows corrupted at the given "
           "rate.", "",
           "| setting | strategy | corrupted | tok/s | tokens/step | ms/step | outside forwards | = ar |",
           "|---|---|---|---|---|---|---|---|"]
    for r in e["runs"]:
        name = r["setting"] + (" + graphs" if r["graphs"] else "")
        if "skipped" in r:
            out.append(f"| {name} | {r['strategy']} | {r['rate']} | skipped | | | | |")
            continue
        out.append(f"| {name} | {r['strategy']} | {r['rate']:.0%} | {r['tokens_per_s']} | {r['tokens_per_step']} | "
                   f"{r['ms_per_step']} | {100 * r['outside_share']:.1f}% | {r['equal_to_ar']} |")
    return out


SECTIONS = {"machine": _machine, "exact": _exact, "costs": _costs, "settings": _settings, "profile": _profile,
            "e2e": _e2e, "real": _real}
