"""The golden runs (record.py) against their committed digests (golden.json): any change of a token,
a tree, an accepted path or a budget record in any of the 432 runs fails here, naming the runs.

A change that is meant (a new budget rule, a new drafter in a strategy) is recorded on purpose:

    .venv/bin/python -m pytest tests/integration/golden --update-golden

and the commit says which runs changed and why.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import record

GOLDEN = Path(__file__).with_name("golden.json")


@pytest.mark.parametrize("name", sorted(record.SETS))
def test_runs_equal_golden(name, request):
    runs = {key: record.digest(run) for key, run in record.SETS[name]().items()}
    assert len(runs) == {"trees": 272, "grammar": 160}[name]
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if request.config.getoption("--update-golden"):
        golden[name] = runs
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    assert name in golden, f"no golden digests for {name!r}: run pytest tests/integration/golden --update-golden"
    changed = sorted(k for k in runs.keys() | golden[name].keys() if runs.get(k) != golden[name].get(k))
    assert not changed, f"{len(changed)} of {len(runs)} {name} runs changed: {changed[:20]}"


def test_digest_sees_a_change():
    """The digest is not blind: one token, one tree node or one budget figure changes it."""
    run = {"ids": [1, 2, 3], "steps": [{"tree": {"tokens": [4, 5], "parents": [-1, 0], "path": [0]},
                                       "modelled_gain": 1.25}]}
    base = record.digest(run)
    assert record.digest(json.loads(json.dumps(run))) == base
    for change in (lambda r: r["ids"].__setitem__(2, 4), lambda r: r["steps"][0]["tree"]["path"].append(1),
                   lambda r: r["steps"][0].__setitem__("modelled_gain", 1.26)):
        other = json.loads(json.dumps(run))
        change(other)
        assert record.digest(other) != base
    other = json.loads(json.dumps(run))
    other["steps"][0]["modelled_gain"] = 1.25 + 1e-13             # below 10 significant digits
    assert record.digest(other) == base
