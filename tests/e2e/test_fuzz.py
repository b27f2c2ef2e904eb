"""Fuzzing what trtspec parses (tests/fuzz/): the seeds load, every crash the fuzzer ever found is
now a clean one-line error (or loads), and each target survives a short coverage-guided run."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parents[1] / "fuzz"
sys.path.insert(0, str(FUZZ))
import harnesses  # noqa: E402

CRASH_FILES = sorted((t, p) for t in harnesses.TARGETS for p in (harnesses.CRASHES / t).glob("*"))


@pytest.fixture(scope="module")
def seeds():
    return harnesses.seed_inputs()


@pytest.mark.parametrize("target", list(harnesses.TARGETS))
def test_seeds_load(seeds, target):
    """The fuzzer starts from valid inputs (a harness that refused its own seeds would test nothing)."""
    assert seeds[target]
    for data in seeds[target]:
        harnesses.TARGETS[target](data)


def test_seeds_are_accepted_not_just_refused(seeds, tmp_path):
    from trtspec.assembly.config import load_config
    from trtspec.export.gguf_loader import load_gguf
    from trtspec.runtime.costs import load
    path = tmp_path / "seed.gguf"
    path.write_bytes(seeds["gguf"][0])
    spec, state = load_gguf(path)
    assert spec.num_layers == 1 and "model.layers.0.mlp.down_proj.weight" in state
    (tmp_path / "costs.json").write_bytes(seeds["costs"][0])
    assert load(tmp_path) is not None
    (tmp_path / "c.yaml").write_bytes(seeds["config"][0])
    assert load_config(str(tmp_path / "c.yaml")).name


@pytest.mark.parametrize("target,path", CRASH_FILES, ids=[f"{t}-{p.name[:14]}" for t, p in CRASH_FILES])
def test_every_crash_found_is_fixed(target, path):
    harnesses.TARGETS[target](path.read_bytes())


@pytest.mark.slow
@pytest.mark.parametrize("target", list(harnesses.TARGETS))
def test_short_fuzz_run_finds_nothing(target):
    """A few seconds of atheris per target (longer runs: python tests/fuzz/run.py TARGET --seconds N)."""
    pytest.importorskip("atheris")
    before = set((harnesses.CRASHES / target).glob("*"))
    proc = subprocess.run([sys.executable, str(FUZZ / "run.py"), target, "--seconds", "4", "--seed", "1"],
                          capture_output=True, text=True, timeout=300)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    new = set((harnesses.CRASHES / target).glob("*")) - before
    for p in new:                                  # keep the tree clean; the failure message shows the input
        p.unlink()
    assert proc.returncode == 0 and not new, f"{summary}\n{proc.stderr[-3000:]}"
    assert summary["runs"] > 0
