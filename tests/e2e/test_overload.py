"""The overload run (`python -m trtspec.tools.bench_serve --overload`) against a real server, small
enough for CI's 2 cores: 2 slots, a queue of 2, 8 clients for 60 s, the tiny pair. Every completed
answer (greedy, seeded sampled, n = 2, JSON schema, stop strings, streamed or not, long prompts)
equals the same request served alone; the bounded queue answers 429 with Retry-After; cancelled
streams free their slots; a prompt over the context is a 400 beside the load; and SIGTERM under
load lets the requests in flight finish, refuses the rest, and exits 0.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_serve import Server
from test_serve import folder  # noqa: F401 - `folder`: fixture (module-scoped here too)

from trtspec.tools import bench_serve

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads processes from /proc")


def overload(server: Server, out: Path, seconds: int, *more: str) -> tuple[int, dict]:
    args = ["--url", server.url, "--overload", str(seconds), "--clients", "8", "--limit", "10", "--max-tokens", "24",
            "--long-tokens", "1000", "--sample-every", "5", "--warm", "20", "--timeout", "120", "--output", str(out),
            *more]
    with pytest.raises(SystemExit) as e:
        bench_serve.main(args)
    return e.value.code, json.loads((out / "overload.json").read_text())


def test_overload_changes_no_answer_and_frees_every_slot(folder, tmp_path):  # noqa: F811
    s = Server(folder, "--max-batch", "2", "--max-queue", "2")
    try:
        rc, report = overload(s, tmp_path, 60)
        summary = report["summary"]
        assert rc == 0, (tmp_path / "overload.md").read_text()
        assert summary["failed"] == 0 and summary["server_errors"] == 0, summary["failures"]
        assert summary["differ_from_solo"] == 0 and summary["completed"] >= 40, summary
        assert summary["kinds_completed"] == len(report["kinds"]) == 12       # 10 prompts x modes, 2 long ones
        assert summary["greedy_completed"] and summary["seeded_completed"]
        assert summary["rejected"] > 0 and summary["rejected_without_retry_after"] == 0   # the bounded queue
        assert summary["cancelled"] > 0 and summary["server_cancelled"] >= summary["cancelled"]
        assert summary["probes"] >= 1 and summary["probes_400"] == summary["probes"]
        assert summary["idle"] == {"status": "ok", "slots": 2, "active": 0, "queued": 0}
        assert max(k["prompt_tokens"] for k in report["kinds"].values()) >= 700               # the long prompt
        assert len(report["samples"]) >= 10 and all(x["rss_bytes"] and x["threads"] and x["open_fds"]
                                                    for x in report["samples"])
        assert summary["soak"]["rss_bytes"]["change"] < 0.10, summary["soak"]
        assert (tmp_path / "overload.png").stat().st_size > 0
    finally:
        assert s.stop() == 0, "".join(s.log)


def test_sigterm_under_load_finishes_what_runs_and_exits_0(folder, tmp_path):  # noqa: F811
    s = Server(folder, "--max-batch", "2", "--max-queue", "4", "--drain-timeout", "120")
    rc, report = overload(s, tmp_path, 30, "--drain-after", "12", "--server-pid", str(s.proc.pid))
    summary = report["summary"]
    assert s.proc.wait(timeout=150) == 0, "".join(s.log)
    drain = summary["drain"]
    assert rc == 0, (tmp_path / "overload.md").read_text()
    assert summary["failed"] == 0 and summary["differ_from_solo"] == 0, summary["failures"]
    assert drain["in_flight"] >= 1 and drain["exit_s"] is not None
    assert drain["in_flight_completed"] >= 1            # and none failed (above): the drain let them finish
    assert summary["drained"] >= 1                      # clients that came after were refused, not served
