"""Run one fuzz target under atheris (coverage-guided, libFuzzer), seeded with valid inputs.

    python tests/fuzz/run.py gguf --seconds 600          # a long local run
    python tests/fuzz/run.py all --seconds 5             # what CI runs (tests/e2e/test_fuzz.py)

Crashing inputs are written to tests/fuzz/crashes/TARGET/ (libFuzzer's artifact prefix), where the
tests replay them forever after; fix the loader, keep the file. The last line printed is a JSON
summary: {"target", "runs", "seconds", "crashes"}. Memory is capped (-rss_limit_mb) so an
allocation sized by a length field read from the input is a crash too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
import harnesses  # noqa: E402


class TooSlow(Exception):
    """An input that took longer than the deadline: a hang is a crash too (kept as an artifact)."""


def with_deadline(fn, seconds: int):
    """`fn` under a SIGALRM deadline that raises TooSlow (atheris then saves the input like any crash)."""
    import signal

    def alarm(signum, frame):
        raise TooSlow(f"one input took over {seconds} s")

    def run(data: bytes) -> None:
        signal.signal(signal.SIGALRM, alarm)
        signal.alarm(seconds)
        try:
            fn(data)
        finally:
            signal.alarm(0)
    return run


def fuzz_one(target: str, seconds: int, rss_mb: int, seed: int) -> None:
    """In this process: seed a corpus, then hand over to libFuzzer (it exits the process)."""
    import atheris
    import numpy, torch, transformers, yaml, gguf, pydantic  # noqa: F401,E401 - loaded uninstrumented
    with atheris.instrument_imports(include=["trtspec"]):     # coverage of our parsers, not of torch
        for name in harnesses.MODULES[target]:
            __import__(name)
    corpus = harnesses.WORK / "corpus"           # WORK: the parent's folder, removed when this child ends
    corpus.mkdir()
    for i, data in enumerate(harnesses.seed_inputs()[target]):
        (corpus / f"seed{i}").write_bytes(data)
    crashes = harnesses.CRASHES / target
    crashes.mkdir(parents=True, exist_ok=True)
    fn = with_deadline(harnesses.TARGETS[target], seconds=10)
    atheris.Setup([sys.argv[0], str(corpus), f"-max_total_time={seconds}", f"-rss_limit_mb={rss_mb}",
                   f"-artifact_prefix={crashes}/", "-print_final_stats=1"]
                  + ([f"-seed={seed}"] if seed else []), fn)
    atheris.Fuzz()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", choices=[*harnesses.TARGETS, "all"])
    p.add_argument("--seconds", type=int, default=60, help="fuzzing time per target")
    p.add_argument("--rss-mb", type=int, default=3072, help="memory cap (torch alone takes ~500 MB)")
    p.add_argument("--seed", type=int, default=0, help="libFuzzer's seed (0: random); CI uses a fixed one")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        fuzz_one(a.target, a.seconds, a.rss_mb, a.seed)
        return 0
    failed = 0
    for target in harnesses.TARGETS if a.target == "all" else [a.target]:
        before = set((harnesses.CRASHES / target).glob("*"))
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"trtspec-fuzz-{target}-") as work:
            proc = subprocess.run([sys.executable, __file__, target, "--seconds", str(a.seconds), "--rss-mb",
                                   str(a.rss_mb), "--seed", str(a.seed), "--child"], capture_output=True, text=True,
                                  env={**os.environ, "TRTSPEC_FUZZ_WORK": work, "TRTSPEC_CACHE": work + "/cache"})
        runs = [int(line.rsplit(":", 1)[1]) for line in proc.stderr.splitlines() if line.startswith("stat::number_of_executed_units")]
        new = sorted(str(p) for p in set((harnesses.CRASHES / target).glob("*")) - before)
        if proc.returncode != 0 or new:
            failed += 1
            sys.stderr.write(proc.stderr[-4000:])
        print(json.dumps({"target": target, "runs": runs[0] if runs else None,
                          "seconds": round(time.monotonic() - t0, 1), "exit": proc.returncode, "crashes": new}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
