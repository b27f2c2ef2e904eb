"""A process's life around the runtime: exit status 0 every time, native resources released in a
defined order, atomic and concurrent-safe builds, memory refused up front, no index host in the tree."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trtspec.assembly.config import load_config
from trtspec.assembly.build import build_engines
from trtspec.engines.manifest import EngineError, verify
from trtspec.assembly.memory import fit, need
from trtspec.errors import RequestError

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
QUIET = dict(log=lambda *a, **k: None)


def cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trtspec.cli", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=600, **kw)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("life")
    cfg = load_config("tiny-random")
    return {b: build_engines(cfg, out / b, backend=b, **QUIET) for b in ("torch", "onnxruntime")}


def assert_clean_exits(folder: Path, runs: int, *extra: str) -> None:
    """`trtspec run` on `folder`, `runs` times: exit 0 and nothing from a native abort, every time."""
    codes = []
    for i in range(runs):
        res = cli("run", "--engines", str(folder), "--prompt", "def f(x):", "--max-new-tokens", "8", *extra)
        codes.append(res.returncode)
        assert res.returncode == 0 and "terminate called" not in res.stderr, (i, res.returncode, res.stderr[-2000:])
    assert codes == [0] * runs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_run_exits_0_every_time(folders, backend):
    assert_clean_exits(folders[backend], 6, "--strategy", "chain")


def test_inspect_exits_0(folders):
    res = cli("inspect", "--engines", str(folders["onnxruntime"]), "--compare")
    assert res.returncode == 0 and "terminate called" not in res.stderr, res.stderr[-2000:]
    assert "onnxruntime" in res.stdout


EMBED = textwrap.dedent("""
    import os, sys
    from trtspec.assembly.load import load_generator
    def threads():
        return len(os.listdir("/proc/self/task"))
    before = threads()
    gen = load_generator(sys.argv[1], threads=2)
    ids = gen.tokenizer("def f(x):")["input_ids"]
    assert len(gen.generate(ids, strategy="chain", max_new_tokens=4).token_ids) == 4
    busy = threads()
    if sys.argv[2] == "close":
        with gen:
            pass
        gen.close()                                  # idempotent
        print(before, busy, threads())
    # "leave": the interpreter exits with the generator open; atexit closes it before teardown
""")


@pytest.mark.parametrize("how", ["close", "leave"])
def test_embedding_api_releases_native_threads_and_exits_0(folders, how):
    """Closing a Generator joins the scheduler and releases ONNX Runtime's sessions (their pool threads
    end); one left open is closed at exit, before interpreter teardown. Exit 0 either way."""
    res = subprocess.run([sys.executable, "-c", EMBED, str(folders["onnxruntime"]), how], capture_output=True,
                         text=True, env=ENV, timeout=300)
    assert res.returncode == 0 and "terminate" not in res.stderr, res.stderr[-2000:]
    if how == "close":
        before, busy, after = map(int, res.stdout.split())
        assert busy > before and after < busy, (before, busy, after)


DROPPED = textwrap.dedent("""
    import atexit, gc, sys, threading, time

    def alive():                                   # registered first: runs after trtspec's exit hooks
        left = [t.name for t in threading.enumerate() if t.name == "trtspec-scheduler" and t.is_alive()]
        print("alive at finalization:", left, flush=True)
    atexit.register(alive)

    from trtspec.assembly.load import load_generator

    class SlowToFree:                              # widens the window: freed by the scheduler thread
        def __del__(self):
            time.sleep(0.5)

    gen = load_generator(sys.argv[1], threads=2)
    gen.generate(gen.tokenizer("def f(x):")["input_ids"], strategy="chain", max_new_tokens=4)
    gen.scheduler.slow = SlowToFree()
    del gen                                        # dropped, not closed: only its lingering thread holds the scheduler
    gc.collect()
    time.sleep(0.2)                                # the thread has left its loop and is freeing it
""")


def test_a_dropped_generator_s_thread_is_gone_before_finalization(folders):
    """A Generator dropped without close(): its scheduler thread, lingering, holds the last reference
    and frees the scheduler (and the batch's tensors) on its way out. Exit waits for it: a daemon
    thread inside torch's tensor free when finalization starts aborts the process (exit 134,
    `terminate called without an active exception`; seen at the end of test runs)."""
    res = subprocess.run([sys.executable, "-c", DROPPED, str(folders["torch"])], capture_output=True, text=True,
                         env=ENV, timeout=300)
    assert res.returncode == 0 and "terminate" not in res.stderr, res.stderr[-2000:]
    assert "alive at finalization: []" in res.stdout, res.stdout


def test_a_closed_generator_refuses_requests(folders):
    from trtspec.assembly.load import load_generator
    with load_generator(folders["onnxruntime"]) as gen:
        ids = gen.tokenizer("x")["input_ids"]
        gen.generate(ids, max_new_tokens=2)
    assert gen.closed and gen.target_engine.session is None
    with pytest.raises(RequestError, match="closed"):
        gen.submit(ids, max_new_tokens=2)
    gen.close()


# ---- builds ----------------------------------------------------------------------------------------

def start_build(out: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trtspec.cli", "build", "--config", "tiny-random", "--backend",
                             "onnxruntime", "--output", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def wait_for_partial(out: Path, proc: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = list(out.parent.glob(f"{out.name}.partial-*"))
        if found and any(found[0].rglob("*.onnx")):        # well into the build: files are being written
            return found[0]
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("the build never wrote a partial folder")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signalled_build_leaves_nothing(tmp_path, sig):
    out = tmp_path / "eng"
    proc = start_build(out, ENV)
    wait_for_partial(out, proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == (143 if sig == signal.SIGTERM else 130), err[-2000:]
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [".eng.lock"]     # no folder, no partial


@pytest.mark.slow
def test_a_killed_builds_partial_folder_is_cleared_by_the_next_build(tmp_path):
    out = tmp_path / "eng"
    proc = start_build(out, ENV)
    partial = wait_for_partial(out, proc)
    proc.kill()
    proc.wait()
    assert partial.exists() and not out.exists()            # what SIGKILL leaves: nothing `run` would load
    other = tmp_path / "other.partial-999999999"             # another folder's, from a process that is gone
    other.mkdir()
    res = cli("build", "--config", "tiny-random", "--backend", "onnxruntime", "--output", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    assert not partial.exists() and not other.exists() and verify(out)
    assert "left by an interrupted build" in res.stdout + res.stderr


def test_two_runs_building_the_same_config_build_it_once(tmp_path):
    """Two `trtspec run --config` at once on an empty cache: one builds, the other waits on the lock
    and uses that folder; both answer, and the cache holds one folder."""
    env = dict(ENV, TRTSPEC_CACHE=str(tmp_path / "cache"))
    args = [sys.executable, "-m", "trtspec.cli", "run", "--config", "tiny-random", "--prompt", "x", "--json",
            "--max-new-tokens", "4", "--threads", "1"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    assert len({json.dumps(json.loads(o[0])["token_ids"]) for o in outs}) == 1
    folders = [p for p in (tmp_path / "cache" / "engines").iterdir() if not p.name.startswith(".")]
    assert len(folders) == 1 and verify(folders[0])
    assert sum("stage" in o[1] for o in outs) == 1            # one printed build progress, the other waited


def test_truncated_graph_data_is_refused_with_the_rebuild_command(folders, tmp_path):
    import shutil
    folder = tmp_path / "cut"
    shutil.copytree(folders["onnxruntime"], folder)
    graph = max((p for p in folder.rglob("*") if p.is_file() and "onnx" in p.name), key=lambda p: p.stat().st_size)
    data = graph.read_bytes()
    graph.write_bytes(data[: len(data) // 2])
    res = cli("run", "--engines", str(folder), "--prompt", "x", "--max-new-tokens", "2")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "truncated or modified" in lines[0] and "trtspec build" in lines[0], res.stderr


# ---- memory ------------------------------------------------------------------------------------------

def test_a_pool_that_cannot_fit_is_refused_before_loading(folders):
    folder = folders["onnxruntime"]
    manifest = verify(folder)
    n = need(folder, manifest, 512, 4)
    assert n.pool("target") == 2 * n.row_bytes["target"] * n.rows * 4       # pool + staging copy
    fit(folder, manifest, 512, 4, available=n.total() * 2)                  # fits
    with pytest.raises(EngineError) as e:
        fit(folder, manifest, 512, 256, available=n.total() * 2)
    msg = str(e.value)
    assert "\n" not in msg and "256 slots" in msg and "available" in msg and "weights" in msg
    best = int(re.search(r"at most (\d+) slots", msg).group(1))
    assert 1 <= best < 256
    fit(folder, manifest, 512, best, available=n.total() * 2)              # the advice fits


def test_serve_refuses_a_pool_over_memory_in_one_line(folders):
    res = cli("serve", "--engines", str(folders["torch"]), "--port", "0", "--max-batch", "256",
              env=dict(ENV, TRTSPEC_MEMORY_LIMIT="50000000"))
    assert res.returncode == 1, res.stderr
    error = [line for line in res.stderr.strip().splitlines() if not line.startswith("loading ")]
    assert len(error) == 1 and "available" in error[0] and "at most" in error[0], res.stderr


# ---- the tree ----------------------------------------------------------------------------------------

INDEX_HOSTS = re.compile(r"pypi\.org|pythonhosted\.org|download\.pytorch\.org|pypi\.nvidia\.com|"
                         r"files\.pythonhosted|anaconda\.org|test\.pypi")


def test_no_package_index_host_in_the_tree():
    res = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = res.stdout.split() if res.returncode == 0 else [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                                                            if p.is_file() and ".venv" not in p.parts]
    hits = []
    for rel in files:
        p = ROOT / rel
        if p.is_file() and p.suffix not in (".png", ".svg", ".onnx") and p.stat().st_size < 5_000_000:
            text = p.read_text(errors="ignore")
            hits += [f"{rel}: {m.group(0)}" for m in INDEX_HOSTS.finditer(text)]
    assert not hits
