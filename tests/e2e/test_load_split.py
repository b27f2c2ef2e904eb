"""lab/load_split.py: a loaded wave's wall time split by what the scheduler's thread did, observed
through the runtime's hooks (the tiny pair's torch folder, 2 clients)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from lab.load_split import main

PROMPTS = [{"id": str(i), "prompt": p} for i, p in enumerate(["def add(a, b):", "for i in range(10):",
                                                              "import numpy as np", "class Stack:"])]


def test_a_wave_is_split_into_forwards_python_and_the_scheduler(torch_folder, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "split.json"
    res = CliRunner().invoke(main, ["--engines", str(torch_folder), "--dataset", str(data), "--limit", "4",
                                    "--max-new-tokens", "12", "--concurrency", "2", "--strategies", "ar,staged",
                                    "--threads", "1", "--json", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())
    assert [r["strategy"] for r in rows] == ["ar", "staged"] and "| ar | 2 |" in res.output
    for r in rows:
        assert r["equal_to_first"] == 4 and r["new_tokens"] == 4 * 12            # every answer = ar's
        fwd = sum(v["seconds"] for role in r["forwards"].values() for v in role.values())
        assert fwd == r["forward_s"] and 0 < fwd < r["seconds"]
        assert r["iterations"] > 0 and all(v >= 0 for v in r["python_s"].values())
        assert r["scheduler_s"] >= 0 and r["outside_iterations_s"] >= 0
        shapes = r["target_step_shapes"]
        assert shapes and max(s["rows"] for s in shapes) == 2 and all(s["ms"] > 0 for s in shapes)
        steps = r["forwards"]["target"]["step"]["steps"] + r["forwards"]["target"]["prefill"]["steps"]
        assert sum(s["forwards"] for s in shapes) <= steps
    ar = rows[0]
    assert "draft" not in ar["forwards"] or not any(v["steps"] for v in ar["forwards"]["draft"].values())
    assert rows[1]["policy"]["policy_steps"] > 0                                 # staged plans with budget: auto
