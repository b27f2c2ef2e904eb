"""An installed wheel works away from the checkout: shipped configs and the tiny tokenizer are package
data, found without the repository. The wheel is built from a copy of the sources, installed (not
editable) into a fresh venv, and `trtspec run --config tiny-random` runs from another directory. The
measurement instruments (lab/) are not in it.

The fresh venv gets trtspec from the wheel alone; its dependencies (torch, onnxruntime, ...) come
from this test's environment through a path file, since downloading them again would take minutes.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sh(*args, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kw)
    assert res.returncode == 0, f"{args}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


@pytest.mark.slow
def test_installed_wheel_runs_from_another_directory(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("trtspec", "lab"):       # the lab beside the product, as in a checkout: it must stay out
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # Without build isolation where setuptools is here (offline-friendly); else pip fetches it.
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    sh(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", tmp_path / "dist", src)
    wheel = next((tmp_path / "dist").glob("trtspec-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert "trtspec" in tops and not {t for t in tops if t != "trtspec" and not t.endswith(".dist-info")}, tops

    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", "--without-pip", venv)
    sh(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q", "--no-deps", "--no-index",
       wheel)
    purelib = Path(sh(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                   .stdout.strip())
    # Dependencies from this environment, appended after the venv's own site-packages (whose trtspec
    # comes first); path files in those folders (our editable install's finder) are not run.
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(TRTSPEC_CACHE=str(tmp_path / "cache"), PYTHONNOUSERSITE="1")
    where = sh(venv / "bin" / "python", "-c", "import trtspec; print(trtspec.__file__)", cwd=elsewhere, env=env)
    assert Path(where.stdout.strip()).is_relative_to(purelib), where.stdout
    res = sh(venv / "bin" / "trtspec", "run", "--config", "tiny-random", "--prompt", "def f(x):",
             "--max-new-tokens", "6", "--json", cwd=elsewhere, env=env)
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["stats"]["new_tokens"] == 6
    listed = sh(venv / "bin" / "python", "-c", "from trtspec.assembly.config import shipped_configs; print(shipped_configs())",
                cwd=elsewhere, env=env)
    assert "qwen2.5-coder-1.5b" in listed.stdout and "tiny-random" in listed.stdout
