"""The llama.cpp peer adapter against a stand-in llama-server (its HTTP protocol, not its speed),
the ORT profile summary on a synthetic trace, and the greedy-agreement tool."""
from __future__ import annotations

import json
import sys

import pytest

from trtspec.errors import RequestError
from lab.agreement import agreement
from trtspec.tools.llamacpp_peers import LlamaCppPeers
from lab.ort_profile import op_times

FAKE_SERVER = '''#!{python}
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
if "--version" in sys.argv:
    print("version: stand-in"); sys.exit(0)
args = sys.argv[1:]
with open(args[args.index("--port") + 1] + ".args", "w") as f:
    json.dump(args, f)
spec = "-md" in args

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def _send(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._send({{"status": "ok"}})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = body["n_predict"]
        timings = {{"prompt_ms": 10.0, "predicted_ms": 40.0}}
        if spec:
            timings.update(draft_n=n, draft_n_accepted=n // 2)
        self._send({{"tokens": [(t + len(body["prompt"])) % 50 for t in range(n)], "timings": timings}})

HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), H).serve_forever()
'''


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    path = tmp_path / "llama-server"
    path.write_text(FAKE_SERVER.format(python=sys.executable))
    path.chmod(0o755)
    monkeypatch.setenv("TRTSPEC_LLAMA_SERVER", str(path))
    monkeypatch.chdir(tmp_path)             # the stand-in writes PORT.args here
    for name in ("t.gguf", "d.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    return tmp_path


def test_llama_cpp_peers_protocol(fake_server):
    config = {"target": {"model": str(fake_server / "t.gguf")}, "draft": {"model": str(fake_server / "d.gguf")}}
    peers = LlamaCppPeers(config, ["llama.cpp", "llama.cpp-spec", "llama.cpp-ngram-mod"], threads=2, capacity=512,
                          log_dir=fake_server / "logs")
    try:
        tokens, stats = peers.run("llama.cpp", [1, 2, 3], 8)
        assert tokens == [(t + 3) % 50 for t in range(8)]
        assert stats["new_tokens"] == 8 and stats["target_steps"] == 8 and stats["prefill_seconds"] == 0.01
        _, spec = peers.run("llama.cpp-spec", [1, 2, 3], 8)
        assert spec["target_steps"] == 4 and spec["mean_accepted"] == 2.0 and spec["draft_tokens"] == 8
        assert peers.settings()["version"] == "version: stand-in"
        args = [json.loads(p.read_text()) for p in sorted(fake_server.glob("*.args"))]
        assert sum("-md" in a for a in args) == 1 and all(a[a.index("-t") + 1] == "2" for a in args)
        assert sorted(a[a.index("--spec-type") + 1] for a in args if "--spec-type" in a) == ["draft-simple",
                                                                                          "ngram-mod"]
        assert "ngram-mod" in peers.settings()["speculative"]["llama.cpp-ngram-mod"]
        with pytest.raises(RequestError, match="llama-server request failed .*llama.cpp.log"):
            peers.servers["llama.cpp"].complete({})     # the server fails: one line naming its log
    finally:
        procs = [s.proc for s in peers.servers.values()]
        peers.close()
    assert all(p.poll() is not None for p in procs)          # no server left behind


def test_llama_cpp_peers_errors(fake_server, monkeypatch):
    config = {"target": {"model": "tiny:0"}}
    with pytest.raises(RequestError, match="tiny:0 .* has none"):
        LlamaCppPeers(config, ["llama.cpp"], 2, 512, fake_server / "logs")
    with pytest.raises(RequestError, match="needs a draft model"):
        LlamaCppPeers({"target": {"model": str(fake_server / "t.gguf")}}, ["llama.cpp-spec"], 2, 512,
                      fake_server / "logs")
    monkeypatch.setenv("TRTSPEC_LLAMA_SERVER", str(fake_server / "missing"))
    with pytest.raises(RequestError, match="TRTSPEC_LLAMA_SERVER=.*missing is not a file"):
        LlamaCppPeers(config, ["llama.cpp"], 2, 512, fake_server / "logs")


def test_a_llama_server_killed_by_an_illegal_instruction_names_the_rebuild(fake_server, monkeypatch):
    """A llama.cpp built with -march=native on a VM that reports AMX but traps it dies with SIGILL
    while loading: one line that says so and gives the rebuild, not a bare status."""
    path = fake_server / "sigill-server"
    path.write_text(f"#!{sys.executable}\nimport os, signal, sys\n"
                    "if '--version' in sys.argv:\n    print('version: stand-in'); sys.exit(0)\n"
                    "os.kill(os.getpid(), signal.SIGILL)\n")
    path.chmod(0o755)
    monkeypatch.setenv("TRTSPEC_LLAMA_SERVER", str(path))
    config = {"target": {"model": str(fake_server / "t.gguf")}}
    with pytest.raises(RequestError, match=r"status -4 while loading \(an illegal instruction: .*LLAMA_ARCH_FLAGS="
                                           r".*-mno-amx-tile.*\); see .*llama.cpp.log"):
        LlamaCppPeers(config, ["llama.cpp"], 2, 512, fake_server / "logs")


def test_ort_profile_assigns_nodes_to_their_run(tmp_path):
    """Runs: a prefill and a warm-up (ignored), then 2 timed runs for T=1 and 2 for T=4."""
    runs = [(0, 100), (200, 50), (300, 10), (400, 12), (500, 30), (600, 34)]       # µs
    events = [{"name": "model_run", "cat": "Session", "ts": ts * 1000, "dur": d * 1000} for ts, d in runs]

    def node(ts, dur, op):
        return {"name": f"n{ts}_kernel_time", "cat": "Node", "ts": ts * 1000, "dur": dur * 1000,
                "args": {"op_name": op}}
    events += [node(10, 90, "MatMul"), node(210, 40, "MatMul")]                  # not timed
    events += [node(301, 6, "MatMul"), node(307, 3, "Softmax"), node(401, 8, "MatMul")]
    events += [node(501, 20, "MatMul"), node(521, 9, "Softmax"), node(601, 24, "MatMul"), node(625, 9, "Softmax")]
    trace = tmp_path / "p.json"
    trace.write_text(json.dumps(events))
    prof = op_times(trace, [1, 4], 2)
    assert prof[1] == {"step_ms": 11.0, "ops": {"MatMul": 7.0, "Softmax": 1.5}}
    assert prof[4] == {"step_ms": 32.0, "ops": {"MatMul": 22.0, "Softmax": 9.0}}
    with pytest.raises(ValueError, match="fewer than"):
        op_times(trace, [1, 4, 8, 16], 2)


def _run(prompts: dict[str, list[int]]) -> dict:
    return {"prompts": [{"id": k, "runs": {"ar": {"token_ids": v}}} for k, v in prompts.items()]}


def test_agreement_counts_identical_outputs_and_first_differences():
    a = _run({"p1": [1, 2, 3, 4], "p2": [5, 6, 7, 8], "p3": [9, 9, 9, 9], "only-a": [1]})
    b = _run({"p1": [1, 2, 3, 4], "p2": [5, 0, 7, 8], "p3": [9, 9, 9, 0]})
    r = agreement(a, b)
    assert (r["prompts"], r["identical"], r["median_first_divergence"]) == (3, 1, 2)
    assert r["tokens_before_first_divergence"] == (4 + 1 + 3) / 12
    with pytest.raises(RequestError, match="no prompt"):
        agreement(a, _run({"other": [1]}))
