"""`trtspec serve --replicas 2` on a local Ray instance (loopback only), tiny folder: the official
openai client gets the single-process server's answers, from both replicas (x-trtspec-replica);
errors, API key, disconnects and metrics as in one process; a replica killed mid-load leaves no
request hanging and every error OpenAI-shaped; a bounded load with random disconnects; SIGTERM
drains and exits 0 with nothing of Ray left running. The config file for `serve deploy` is checked
against Ray Serve's own schema."""
from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from click.testing import CliRunner
from test_serve import LONG, MODEL, PROMPTS, Server, metric_values, rss_kib, spec, stream_or_leave, wait_idle
from test_serve import folder  # noqa: F401 - `folder`: fixture (module-scoped here too)

from trtspec.cli import main
from trtspec.tools import bench_serve

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-ray-test"
STRATEGIES = ("ar", "chain", "staged")
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads processes from /proc")


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (Ray's GCS, raylet, workers, replicas are the driver's descendants)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def engine_replicas(server: Server) -> list[int]:
    return sorted(p for p in descendants(server.proc.pid)
                  if "ServeReplica:trtspec:Engine" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"))


class RayServer(Server):
    def __init__(self, folder: Path, *args: str):
        super().__init__(folder, "--replicas", "2", "--max-batch", "2", "--api-key", KEY, *args)
        self.pids = descendants(self.proc.pid)        # Ray's processes, to be gone after the server

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return super().client(key, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return super().get(path, headers={"Authorization": f"Bearer {KEY}"}, **kw)

    def health(self, want_replicas: int = 2, seconds: float = 60) -> dict:
        """/health once `want_replicas` replicas report (after a start or a restart)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            h = self.get("/health").json()
            if h["replicas"] == want_replicas:
                return h
            time.sleep(0.2)
        raise AssertionError(f"replicas never reported: {h}")


@pytest.fixture(scope="module")
def solo(folder):
    s = Server(folder, "--max-batch", "4")
    yield s
    assert s.stop() == 0, "".join(s.log)


@pytest.fixture(scope="module")
def ray_server(folder):
    s = RayServer(folder, "--drain-timeout", "120")   # LONG tokens finish draining on a loaded 2-core runner
    s.health()
    yield s
    if s.proc.poll() is None:
        s.stop()


def completion(c: openai.OpenAI, prompt: str, strategy: str, n: int = 24, **kw):
    return c.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                  extra_body=spec(strategy), **kw)


def test_answers_equal_the_single_process_server_from_both_replicas(ray_server, solo):
    replicas = set()
    c, ref = ray_server.client(), solo.client()
    for strategy in STRATEGIES:
        for prompt in PROMPTS:
            want = ref.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body=spec(strategy))
            raw = completion(c, prompt, strategy)
            replicas.add(raw.headers["x-trtspec-replica"])
            got = raw.parse()
            assert got.choices[0].text == want.choices[0].text and got.usage == want.usage
        chat = [{"role": "user", "content": PROMPTS[1]}]
        want = ref.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0,
                                           extra_body=spec(strategy))
        stream = c.chat.completions.create(model=MODEL, messages=chat, max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body=spec(strategy))
        chunks = list(stream)
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.choices[0].message.content
        assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    # n choices with a seed: the same samples as one process (each choice's RNG is the request's own)
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0.8, n=3, seed=7, extra_body=spec("ar"))
    assert [ch.text for ch in c.completions.create(**kw).choices] == [ch.text for ch in ref.completions.create(**kw).choices]
    assert len(replicas) == 2, f"one replica served everything: {replicas}"


def test_errors_deadlines_stats_and_the_api_key_are_as_in_one_process(ray_server, solo):
    c = ray_server.client()
    asks = [dict(model="nope", prompt="x"), dict(model=MODEL, prompt="x", max_tokens=5000),
            dict(model=MODEL, prompt="x", extra_body=spec("nope")), dict(model=MODEL, prompt="x", temperature=-1),
            dict(model=MODEL, prompt="x", extra_body={"speculative": {"strategy": "chain", "k": 0}})]
    for ask in asks:
        with pytest.raises(openai.APIStatusError) as got:
            c.completions.create(**ask)
        with pytest.raises(openai.APIStatusError) as want:
            solo.client().completions.create(**ask)
        assert got.value.status_code == want.value.status_code and got.value.body == want.value.body
    for server in (ray_server, solo):                 # a deadline: 408 (a final error event when streamed)
        with pytest.raises(openai.APIStatusError) as e:
            server.client().completions.create(model=MODEL, prompt="x", max_tokens=LONG, temperature=0,
                                               extra_body={"timeout": 0.2, "ignore_eos": True})
        assert e.value.status_code == 408 and e.value.body["code"] == "deadline_exceeded"
    stats = c.completions.create(model=MODEL, prompt="x", max_tokens=8, temperature=0,
                                 extra_body=spec("chain", stats=True)).model_extra["speculative_stats"]
    assert stats["strategy"] == "chain" and stats["steps"] >= 1
    with pytest.raises(openai.AuthenticationError) as e:
        ray_server.client(key="wrong").completions.create(model=MODEL, prompt="x")
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.BadRequestError) as e:   # a prompt over the context: the ingress's 400, queue or not
        c.completions.create(model=MODEL, prompt=[5] * 4096, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and "4096-token context" in e.value.body["message"]
    assert httpx.get(ray_server.base + "/health", timeout=10).status_code == 200    # no key needed
    assert ray_server.get("/version").json()["strategies"] == solo.get("/version").json()["strategies"]


def test_a_client_that_leaves_frees_its_slot_on_the_replica(ray_server):
    with httpx.stream("POST", ray_server.url + "/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json=dict(model=MODEL, prompt="x", max_tokens=LONG, temperature=0, stream=True, ignore_eos=True)) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    wait_idle(ray_server)                              # the replica cancelled it: its slot is free again
    with pytest.raises(openai.APITimeoutError):
        ray_server.client().with_options(timeout=0.5).completions.create(
            model=MODEL, prompt="x", max_tokens=LONG, temperature=0, extra_body=spec("ar") | {"ignore_eos": True})
    wait_idle(ray_server)


def test_metrics_carry_each_replica_on_one_endpoint(ray_server):
    def tokens() -> dict[str, float]:
        return {dict(k[1])["replica"]: v for k, v in metric_values(ray_server).items()
                if k[0] == "trtspec_generation_tokens_total"}
    def settled() -> dict[str, float]:                 # replicas push every second: wait for the last push
        now = tokens()
        for _ in range(10):                            # (an earlier test's cancelled requests may still count)
            time.sleep(1.5)
            now, last = tokens(), now
            if now == last:
                break
        return now
    before, c, served = settled(), ray_server.client(), []
    for i in range(6):
        served.append(completion(c, PROMPTS[i % 4], "ar", n=10).headers["x-trtspec-replica"])
    after = settled()
    for name in set(served):
        assert after[name] - before.get(name, 0) == 10 * served.count(name)
    values = metric_values(ray_server)
    assert {dict(k[1])["replica"] for k in values if k[0] == "trtspec_slots"} >= set(served)
    assert values[("trtspec_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 6


def test_bounded_load_with_random_disconnects(ray_server, solo):
    """8 clients x 100 requests through Ray Serve, about 1 in 5 dropped mid-stream: every completed
    answer equals its solo answer, the replicas' slots are free at the end, their memory flat."""
    c = ray_server.client()
    jobs = [(p, s) for p in PROMPTS for s in STRATEGIES]
    want = {job: solo.client().completions.create(model=MODEL, prompt=job[0], max_tokens=8, temperature=0,
                                                  extra_body=spec(job[1])).choices[0].text for job in jobs}
    rng = random.Random(1)
    plan = [(rng.choice(jobs), rng.random() < 0.2) for _ in range(800)]

    def one(i: int):
        job, drop = plan[i]
        text = stream_or_leave(c, *job, max_tokens=8, leave=drop)
        return None if text is None else (job, text)

    rss, results = {}, []
    with ThreadPoolExecutor(8) as pool:
        for part in (range(400), range(400, 800)):
            results += list(pool.map(one, part))
            rss[part.stop] = sum(rss_kib(p) for p in engine_replicas(ray_server))
    done = [r for r in results if r is not None]
    assert len(done) >= 560 and all(text == want[job] for job, text in done)
    print(f"replicas' resident KiB after 400 and 800 requests: {rss}; completed {len(done)}/800")
    assert rss[800] - rss[400] < 32 * 1024, rss
    wait_idle(ray_server)


def test_a_killed_replica_leaves_no_request_hanging(ray_server, solo):
    """SIGKILL one Engine replica while 8 long streams run (4 on slots, 4 queued): each ends, as a whole
    answer equal to one process's or an OpenAI error event; Ray restarts the replica; both serve."""
    n = 2000
    want = solo.client().completions.create(model=MODEL, prompt="x", max_tokens=n, temperature=0,
                                            extra_body=spec("ar") | {"ignore_eos": True}).choices[0].text

    def one(_):
        # A queued stream's headers come when it gets a slot, after a running 2,000-token stream: on a
        # loaded CI machine that took over 60 s (2026-12-07), so the read may wait 240 s; none hangs past 300
        with httpx.stream("POST", ray_server.url + "/completions", timeout=httpx.Timeout(60, read=240),
                          headers={"Authorization": f"Bearer {KEY}"},
                          json=dict(model=MODEL, prompt="x", max_tokens=n, temperature=0, stream=True,
                                    ignore_eos=True, speculative={"strategy": "ar"})) as r:
            assert r.status_code == 200
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            assert set(last["error"]) == {"message", "type", "param", "code"}
            return last["error"]["code"]
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    victim = engine_replicas(ray_server)[0]
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        outcomes = [f.result(timeout=300) for f in futures]     # none hangs
    failed = [o for o in outcomes if o == "replica_failed"]
    assert 1 <= len(failed) <= 2, outcomes                    # the victim's running streams, no others
    assert all(o == want for o in outcomes if o != "replica_failed")
    ray_server.health(want_replicas=2)
    deadline, seen = time.monotonic() + 60, set()
    while len(seen) < 2 and time.monotonic() < deadline:
        raw = completion(ray_server.client(), PROMPTS[0], "ar", n=4)
        seen.add(raw.headers["x-trtspec-replica"])
    assert len(seen) == 2 and victim not in engine_replicas(ray_server)


def test_overload_with_a_replica_killed_midway(ray_server, tmp_path):
    """8 clients over 2 replicas of 2 slots for 40 s (bench_serve --overload), one replica SIGKILLed 10 s
    in: no request fails but the victim's own answers (a retryable 503 replica_failed), every completed
    answer equals its solo answer, the other replica serves meanwhile, and Ray replaces the victim."""
    victim = engine_replicas(ray_server)[0]
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--url", ray_server.url, "--api-key", KEY, "--overload", "40", "--clients", "8",
                          "--limit", "10", "--max-tokens", "24", "--long-tokens", "0", "--sample-every", "5",
                          "--warm", "20", "--kill-after", "10", "--kill-pid", str(victim), "--output", str(tmp_path)])
    report = json.loads((tmp_path / "overload.json").read_text())
    summary = report["summary"]
    assert e.value.code == 0, (tmp_path / "overload.md").read_text()
    assert summary["failed"] == 0 and summary["differ_from_solo"] == 0, summary["failures"]
    killed = summary["kill"]["at_s"]
    served = [r for r in report["records"] if r["status"] == 200 and killed < r["t0"] < killed + 5]
    assert served, "nothing was served in the 5 s after the kill"
    ray_server.health(want_replicas=2)
    assert victim not in engine_replicas(ray_server)


def test_sigterm_drains_and_exits_0_leaving_nothing_running(ray_server):
    c = ray_server.client()
    stream = c.completions.create(model=MODEL, prompt="x", max_tokens=LONG, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body=spec("ar") | {"ignore_eos": True})
    chunks = [next(iter(stream))]
    pids = ray_server.pids | descendants(ray_server.proc.pid)
    ray_server.proc.send_signal(signal.SIGTERM)
    for _ in range(20):                                # the server notices within a second
        refused = httpx.post(ray_server.url + "/completions", headers={"Authorization": f"Bearer {KEY}"},
                             timeout=10, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        if refused.status_code != 200:
            break
        time.sleep(0.2)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    chunks += list(stream)
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == LONG
    assert ray_server.proc.wait(timeout=180) == 0, "".join(ray_server.log)
    time.sleep(1)
    assert not [p for p in pids if alive(p)], "Ray processes outlived the server"


def test_the_config_file_is_one_ray_serve_deploys(folder):
    from ray.serve.schema import ServeDeploySchema

    from trtspec.serve.ray_serve import Settings, build, deployment_options
    doc = yaml.safe_load((ROOT / "docs" / "ray-serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    app = schema.applications[0]
    assert app.import_path == "trtspec.serve.ray_serve:build"
    assert set(app.args) <= set(Settings.__dataclass_fields__)
    assert {d.name for d in app.deployments} <= {"Api", "Engine", "Metrics"}
    built = build(app.args | {"engines": str(folder)})              # the builder takes the file's args
    assert type(built).__name__ == "Application"
    auto = deployment_options(Settings(engines=str(folder), min_replicas=1, max_replicas=4), slots=4)
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1,
                                               "target_ongoing_requests": 4, "upscale_delay_s": 5.0,
                                               "downscale_delay_s": 30.0}
    assert auto["max_ongoing_requests"] == 4 and "num_replicas" not in auto


def test_without_ray_installed_serve_says_how_to_get_it(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "trtspec.serve.ray_serve", raising=False)
    res = CliRunner().invoke(main, ["serve", "--engines", str(folder), "--replicas", "2", "--port", "0"])
    assert res.exit_code != 0 and "pip install 'trtspec[ray]'" in res.output and "Traceback" not in res.output
    out = subprocess.run([sys.executable, "-c", "import sys; sys.modules['ray'] = None\n"
                          "import trtspec.cli, trtspec.serve.app, trtspec.serve.server"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr            # one process needs no Ray


def test_replicas_that_cannot_fit_this_machine_are_one_line_before_ray_starts(folder, monkeypatch):
    res = CliRunner().invoke(main, ["serve", "--engines", str(folder), "--replicas", "2", "--threads", "256",
                                    "--port", "0"])
    assert res.exit_code != 0 and "need 512 CPUs" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    from trtspec.assembly.load import check_fits, open_folder
    monkeypatch.setenv("TRTSPEC_MEMORY_LIMIT", str(100 << 20))   # one replica's KV pools fit, two do not
    manifest, cfg, _ = open_folder(folder)
    check_fits(folder, manifest, cfg, 8, copies=1)
    args = ["serve", "--engines", str(folder), "--threads", "1", "--max-batch", "8", "--port", "0"]
    res = CliRunner().invoke(main, args + ["--replicas", "2"])
    assert res.exit_code != 0 and "2 replicas share this machine's memory" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 1


def test_a_cluster_address_nobody_listens_on_is_one_line(folder):
    with socket.socket() as s:                         # a loopback port that refuses connections
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = CliRunner().invoke(main, ["serve", "--engines", str(folder), "--replicas", "1", "--port", "0",
                                    "--ray-address", f"127.0.0.1:{port}"])
    assert res.exit_code != 0 and "cannot join the Ray cluster" in res.output and "Traceback" not in res.output
