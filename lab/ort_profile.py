"""Where an ONNX Runtime step's time goes, from ORT's own profiler trace (`stepcost --profile`).

ORT writes one JSON event per node run (`cat: "Node"`, `args.op_name`) and one per session run
(`name: "model_run"`). Node events are assigned to the run whose interval holds them; the last
`len(sizes) * repeats` runs are the timed steps, `repeats` per size, in order.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def op_times(trace: str | Path, sizes: list[int], repeats: int) -> dict[int, dict]:
    """{T: {"step_ms": ..., "ops": {op_type: ms per step}}} for the timed steps of a trace."""
    events = json.loads(Path(trace).read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")
    timed = runs[-len(sizes) * repeats:]
    if len(timed) < len(sizes) * repeats:
        raise ValueError(f"{trace} holds {len(runs)} runs, fewer than the {len(sizes) * repeats} timed steps")
    nodes = sorted((e["ts"], e["dur"], e["args"].get("op_name", "?")) for e in events
                   if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"))
    out, i = {}, 0
    for k, t in enumerate(sizes):
        ops: dict[str, float] = defaultdict(float)
        step_us = 0.0
        for start, end in timed[k * repeats:(k + 1) * repeats]:
            step_us += end - start
            while i < len(nodes) and nodes[i][0] < start:
                i += 1
            while i < len(nodes) and nodes[i][0] <= end:
                ops[nodes[i][2]] += nodes[i][1]
                i += 1
        out[t] = {"step_ms": round(step_us / repeats / 1000, 3),
                  "ops": {op: round(us / repeats / 1000, 3) for op, us in sorted(ops.items(), key=lambda x: -x[1])}}
    return out


def table(profile: dict[int, dict], top: int = 8) -> str:
    """Markdown: ms per step for the `top` op types (by the largest T's share), per T."""
    sizes = sorted(profile)
    ops = list(profile[sizes[-1]]["ops"])[:top]
    lines = ["| op | " + " | ".join(f"T={t} ms (share)" for t in sizes) + " |", "|---|" + "---|" * len(sizes)]
    for op in ops:
        cells = [f"{profile[t]['ops'].get(op, 0):.1f} ({profile[t]['ops'].get(op, 0) / profile[t]['step_ms']:.0%})"
                 for t in sizes]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    lines.append("| whole step | " + " | ".join(f"{profile[t]['step_ms']:.1f}" for t in sizes) + " |")
    return "\n".join(lines)
