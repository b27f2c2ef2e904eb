"""Resident memory and wall time of a command, by stage: what docs/benchmarks.md's build tables hold.

    python -m lab.build_memory [--out FILE.json] -- trtspec build --config qwen2.5-coder-1.5b --output DIR

Runs the command, samples the resident memory of its whole process tree every 0.2 s (/proc), and
tags each sample with the stage the command's progress bars show last on stderr (`role: source`
and the stage in the bar's brackets, or an inner bar's own title). Prints a markdown table (stage,
seconds, peak RSS) and the peak over the run (the kernel's own high-water mark of the largest
process, as `/usr/bin/time -v` reports it); stderr passes through unchanged.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

_BAR = re.compile(r"(?:^|\r)([^\r\n|]*?):\s+\d+%\|[^\r\n]*?(?:, ([^\]\r\n]+))?\]")


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and every descendant."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(d.name))
            rss[int(d.name)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def stage_of(text: str) -> str | None:
    """The stage a chunk of progress-bar output shows last."""
    found = None
    for m in _BAR.finditer(text):
        title, post = m.group(1).strip(), m.group(2)
        role = title.split(":")[0]
        found = (f"{role}: {post.split(', ')[-1].strip()}" if post and ":" in title and "writing" not in title
                 else title)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write the samples and the table as JSON here")
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        ap.error("give the command after --")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE)
    state = {"stage": "start"}
    order: list[str] = []
    stages: dict[str, dict] = {}

    def read() -> None:
        while chunk := os.read(proc.stderr.fileno(), 65536):
            sys.stderr.buffer.write(chunk)
            sys.stderr.flush()
            if s := stage_of(chunk.decode("utf-8", "replace")):
                state["stage"] = s

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    samples = []
    while proc.poll() is None:
        now, rss, st = time.monotonic() - t0, tree_rss(proc.pid), state["stage"]
        samples.append((round(now, 2), rss, st))
        if st not in stages:
            order.append(st)
            stages[st] = {"first": now, "last": now, "peak": 0}
        stages[st]["last"] = now
        stages[st]["peak"] = max(stages[st]["peak"], rss)
        time.sleep(args.interval)
    reader.join(timeout=5)
    wall = time.monotonic() - t0
    hwm = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    rows = [(s, stages[s]["last"] - stages[s]["first"], stages[s]["peak"]) for s in order]
    print("| stage | s | peak RSS (GB) |\n|---|---|---|")
    for s, secs, peak in rows:
        print(f"| {s} | {secs:.0f} | {peak / 1e9:.2f} |")
    print(f"| **whole run** (exit {proc.returncode}) | {wall:.0f} | **{max([r[2] for r in rows] or [0]) / 1e9:.2f}** "
          f"(largest process's high-water mark {hwm / 1e9:.2f}) |")
    if args.out:
        args.out.write_text(json.dumps({"command": cmd, "exit": proc.returncode, "seconds": wall, "max_rss": hwm,
                                        "stages": [{"stage": s, "seconds": secs, "peak_rss": peak} for s, secs, peak in rows],
                                        "samples": samples}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
