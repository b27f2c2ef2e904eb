"""A weightless graph export in a Python process of its own, while the caller does other work (the
build exports the draft's graph while it writes the target's: the exporter is single-threaded
Python, minutes for a real model).

A plain subprocess, `python -m trtspec.engines.export_worker`, not multiprocessing: a spawned
multiprocessing worker first re-runs the caller's main script, and a build embedded in a script
without a `__main__` guard would then wait on its own build lock forever (and the pool leaves a
semaphore warning at exit). The answer comes back pickled on a private pipe; whatever the exporter
prints goes to a temporary file, read only to report a failure."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path


class ExportJob:
    """export_graph_bytes(spec, dtype, exact, opset, fused), running in another process from construction."""

    def __init__(self, spec: dict, dtype: str, exact: bool | str, opset: int, fused: tuple[str, ...] = ()):
        root = str(Path(__file__).resolve().parents[2])          # this trtspec, installed or not
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec), dtype, json.dumps(exact),
                                      str(opset), ",".join(fused)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env)

    def get(self):
        """(graph bytes, refs), or None where the worker failed (the caller exports in place, and
        meets the same error there if it is the export's)."""
        out, _ = self.proc.communicate()
        if self.proc.returncode != 0:
            return None
        try:
            return pickle.loads(out)
        except Exception:                       # noqa: BLE001 - a truncated answer: export in place
            return None

    def error(self) -> str:
        """The worker's last line of output (why it failed)."""
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"exit status {self.proc.returncode}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()
        self.log.close()


def _main(argv: list[str]) -> None:
    answer = os.fdopen(os.dup(1), "wb")      # the pickle's own pipe; anything printed goes to stderr
    os.dup2(2, 1)
    from .stream import export_graph_bytes
    result = export_graph_bytes(json.loads(argv[1]), argv[2], json.loads(argv[3]), int(argv[4]),
                                tuple(n for n in argv[5].split(",") if n))
    answer.write(pickle.dumps(result))
    answer.close()


if __name__ == "__main__":
    _main(sys.argv)
