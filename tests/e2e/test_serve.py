"""`trtspec serve` as a client sees it: a real server process on a free loopback port, driven by the
official `openai` client (and httpx where the client hides what is tested: raw bodies, disconnects).

Greedy answers equal `trtspec run` on the same prompt and strategy, token for token (text and
count), streamed or not, completion or chat; every error case has its status and message; a client
that disconnects frees its slot; /metrics parses and matches what was sent; SIGTERM drains.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from click.testing import CliRunner
from conftest import with_chat_template
from prometheus_client.parser import text_string_to_metric_families

from trtspec.assembly.build import build_engines
from trtspec.assembly.config import Config, load_config
from trtspec.cli import main
from trtspec.runtime.strategies import STRATEGIES
from trtspec.runtime.text import TextStream

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny-random"
LONG = 4000
PROMPTS = ["def fib(n):", "x = 1\ny = 2\n", "import numpy as np\n", "class A:\n    def f(self):"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "torch"
    # Room for requests that run for seconds (LONG tokens), so disconnects and drains meet a running one.
    cfg = Config.from_dict(load_config("tiny-random").model_dump(mode="json") | {"max_seq_len": 4096})
    build_engines(cfg, out, backend="torch", log=lambda *a, **k: None)
    return with_chat_template(out, tmp_path_factory.mktemp("serve-chat"))


class Server:
    """`trtspec serve` in a subprocess on a free port (--port 0); `url` once it listens."""

    def __init__(self, folder: Path, *args: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "trtspec.cli", "serve", "--engines", str(folder),
                                      "--port", "0", "--threads", "1", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.log: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"on (http://[\d.]+:\d+)/v1", line)
            if m:
                self.base = m.group(1)
                self.url = self.base + "/v1"
                threading.Thread(target=self._drain_log, daemon=True).start()
                return
        self.proc.kill()
        raise AssertionError("server did not start:\n" + "".join(self.log))

    def _drain_log(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=60, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.base + path, timeout=30, **kw)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(folder):
    s = Server(folder, "--max-batch", "4", "--max-queue", "16")
    yield s
    assert s.stop() == 0, "".join(s.log)


def run_json(folder: Path, prompt: str, strategy: str, n: int, chat: bool = False) -> dict:
    args = ["run", "--engines", str(folder), "--prompt", prompt, "--strategy", strategy, "--max-new-tokens", str(n),
            "--json", "--threads", "1"] + (["--chat"] if chat else [])
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    return json.loads(res.output.strip().splitlines()[-1])


def spec(strategy: str, **more) -> dict:
    return {"speculative": {"strategy": strategy, **more}}


def metric_values(server: Server) -> dict[tuple, float]:
    text = server.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# ---------------------------------------------------------------------------------------------
# Answers: equal to `trtspec run`
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_completion_equals_trtspec_run(server, folder, strategy):
    prompt = PROMPTS[len(strategy) % len(PROMPTS)]
    want = run_json(folder, prompt, strategy, 24)
    c = server.client()
    got = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=spec(strategy))
    assert got.choices[0].text == want["text"]
    assert got.choices[0].finish_reason == want["finish_reason"] == "length"
    assert got.usage.completion_tokens == len(want["token_ids"]) == 24
    stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body=spec(strategy))
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want["text"]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_chat_equals_trtspec_run_chat(server, folder, strategy):
    c = server.client()
    want = run_json(folder, PROMPTS[0], strategy, 16, chat=True)
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    got = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                    extra_body=spec(strategy))
    assert got.choices[0].message.content == want["text"] and got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == len(want["token_ids"])
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=16, temperature=0,
                                       stream=True, extra_body=spec(strategy))
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want["text"]


def test_token_id_prompt_equals_its_text(server, folder):
    c = server.client()
    plain = run_json(folder, PROMPTS[1], "chain", 12)
    tok = server_tokenizer(folder)
    ids = tok(PROMPTS[1])["input_ids"]
    got = c.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body=spec("chain"))
    assert got.choices[0].text == plain["text"] and got.usage.prompt_tokens == len(ids)


def server_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder / "tokenizer"))


def test_stop_strings_are_cut_across_tokens_and_never_emitted(server, folder):
    c = server.client()
    full = run_json(folder, PROMPTS[2], "chain", 32)
    tok = server_tokenizer(folder)
    ids = full["token_ids"]
    # A stop string that spans a token boundary: the end of token i's text and the start of token i+1's.
    for i in range(3, len(ids) - 2):
        a, b = tok.decode(ids[:i], skip_special_tokens=True), tok.decode(ids[:i + 1], skip_special_tokens=True)
        if len(a) >= 2 and len(b) - len(a) >= 2 and "\ufffd" not in b and full["text"].find(a[-2:] + b[len(a)]) >= 0:
            stop = a[-2:] + b[len(a)]
            break
    else:
        pytest.skip("no token boundary with two clean characters on each side")
    want = full["text"][: full["text"].find(stop)]
    for stream in (False, True):
        r = c.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=32, temperature=0, stop=[stop, "@@@"],
                                 stream=stream, extra_body=spec("chain"))
        chunks = list(r) if stream else [r]
        assert "".join(ch.choices[0].text for ch in chunks) == want
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_text_stream_holds_back_what_could_become_a_stop_string():
    class Chars:          # a tokenizer whose tokens are characters
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(i) for i in ids)
    s = TextStream(Chars(), ["END"])
    assert s.feed([ord("a"), ord("E")]) == "a"          # "E" might start "END"
    assert s.feed([ord("x")]) == "Ex"
    assert s.feed([ord("E"), ord("N")]) == ""
    assert s.feed([ord("D"), ord("z")]) == "" and s.stopped and s.text == "aEx"
    s = TextStream(Chars(), ["END"])
    s.feed([ord("a"), ord("E")])
    assert s.finish() == "E"                             # the end releases what was held back


def test_seed_reproduces_a_sample(server):
    c = server.client()
    ask = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=1.0, extra_body=spec("chain"))
    a = c.completions.create(seed=7, **ask).choices[0].text
    assert c.completions.create(seed=7, **ask).choices[0].text == a
    assert any(c.completions.create(seed=s, **ask).choices[0].text != a for s in (8, 9, 10))


def test_speculative_stats_on_request(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                             extra_body=spec("staged", budget=4, stats=True))   # fixed: always drafts
    st = r.speculative_stats
    assert st["strategy"] == "staged" and st["steps"] >= 1 and st["mean_accepted_length"] == 16 / st["steps"]
    assert st["draft_forwards"] > 0 and st["verify_seconds"] > 0
    plain = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert getattr(plain, "speculative_stats", None) is None


def test_models_health_version(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    h = server.get("/health").json()
    assert h["status"] == "ok" and h["slots"] == 4
    v = server.get("/version").json()
    assert v["backend"] == "torch" and v["contract_version"] == 4 and "staged" in v["strategies"]


# ---------------------------------------------------------------------------------------------
# Errors: OpenAI-style, the right status, naming the field
# ---------------------------------------------------------------------------------------------

def assert_error(exc_info, status: int, *words: str, param: str | None = None) -> None:
    err = exc_info.value
    assert err.status_code == status, err
    body = err.body if isinstance(err.body, dict) else json.loads(err.response.text)["error"]
    for w in words:
        assert w in body["message"], body
    if param is not None:
        assert body["param"] == param, body


def test_error_cases(server):
    c = server.client()
    ok = dict(model=MODEL, prompt="x", max_tokens=4, temperature=0)
    cases = [
        (dict(ok, max_tokens=0), 400, ("max_tokens", "greater than or equal to 1"), "max_tokens"),
        (dict(ok, max_tokens=100_000), 400, ("100000", "4096"), "max_tokens"),
        (dict(ok, n=129), 400, ("n",), "n"),
        (dict(ok, n=100), 400, ("n must be at most",), "n"),
        (dict(ok, temperature=-1), 400, ("temperature",), "temperature"),
        (dict(ok, stop=["a", "b", "c", "d", "e"]), 400, ("at most 4",), "stop"),
        (dict(ok, presence_penalty=2.5), 400, ("presence_penalty",), "presence_penalty"),
        (dict(ok, echo=True), 400, ("echo is not supported",), "echo"),
        (dict(ok, logit_bias={"x": 1}), 400, ("logit_bias keys are token ids",), "logit_bias"),
        (dict(ok, logit_bias={"3": 101}), 400, ("[-100, 100]",), "logit_bias"),
        (dict(ok, logit_bias={"100000": 1}), 400, ("logit_bias token id 100000",), None),
        (dict(ok, logprobs=21), 400, ("logprobs",), "logprobs"),
        (dict(ok, extra_body={"min_tokens": -1}), 400, ("min_tokens",), "min_tokens"),
        (dict(ok, extra_body={"repetition_penalty": 0}), 400, ("repetition_penalty",), "repetition_penalty"),
        (dict(ok, extra_body={"stop_token_ids": [-5]}), 400, ("stop token id -5",), None),
        (dict(ok, extra_body={"structured_outputs": {"regex": "a", "grammar": "b"}}), 400, ("exactly one",),
         "structured_outputs"),
        (dict(ok, extra_body={"structured_outputs": {"regex": "(unclosed"}}), 400, ("regex cannot be compiled",),
         "structured_outputs"),
        (dict(ok, extra_body={"response_format": {"type": "json_schema"}}), 400, ("json_schema",), "response_format"),
        (dict(ok, extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}}}), 400,
         ("json schema cannot be compiled",), "response_format"),
        (dict(ok, extra_body={"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
         400, ("not both",), "structured_outputs"),
        (dict(ok, extra_body={"frobnicate": 1}), 400, ("unknown field 'frobnicate'",), "frobnicate"),
        (dict(ok, extra_body=spec("nope")), 400, ("unknown strategy 'nope'", "staged"), "speculative.strategy"),
        (dict(ok, extra_body=spec("chain", k=0)), 400, ("speculative.k",), "speculative"),
        (dict(ok, extra_body=spec("chain", kk=3)), 400, ("kk",), "speculative"),
        (dict(ok, extra_body=spec("cascade", bigram="/etc/passwd")), 400, ("file on the server",), None),
        (dict(ok, extra_body=spec("suffix", scope="someone-else")), 400, ("whose history",), None),
        (dict(ok, extra_body=spec("suffix", global_nodes=50_000_000)), 400, ("server's memory",), None),
        (dict(ok, prompt=[]), 400, ("empty",), "prompt"),
        (dict(ok, prompt=["a", "b"]), 400, ("one prompt per request",), "prompt"),
        (dict(ok, prompt=[10**6]), 400, ("outside the model's vocabulary",), None),
        (dict(ok, seed=2**64), 400, ("seed",), "seed"),
        (dict(ok, stop=["x" * 300]), 400, ("at most 256 characters",), "stop"),
        (dict(ok, prompt="word " * 60_000), 400, ("characters", "4096-token"), "prompt"),
    ]
    for kwargs, status, words, param in cases:
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(**kwargs)
        assert_error(e, status, *words, param=param)
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(**dict(ok, model="gpt-4"))
    assert_error(e, 404, "'gpt-4' not found", MODEL, param="model")
    r = httpx.post(server.url + "/completions", content=b'{"model": ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/completions", content=b"hello")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[
            {"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert_error(e, 400, "tools is not supported", param="tools")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "x", "tool_calls": []}])
    assert_error(e, 400, "tool_calls")
    # null means "not given", as in OpenAI's API (some SDKs send it)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert_error(e, 400, "top_logprobs needs logprobs", param="top_logprobs")
    r = httpx.post(server.url + "/completions", json=dict(ok, temperature=None, top_p=None, n=None, stream=None,
                                                          presence_penalty=None, seed=None, stop=None))
    assert r.status_code == 200, r.text
    assert server.get("/health").json()["active"] == 0


def test_deadline(server):
    c = server.client()
    with pytest.raises(openai.APIStatusError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=LONG, temperature=0,
                             extra_body={"timeout": 0.001, "ignore_eos": True})
    assert_error(e, 408, "deadline")
    stream = c.completions.create(model=MODEL, prompt="x", max_tokens=LONG, temperature=0, stream=True,
                                  extra_body={"timeout": 0.001, "ignore_eos": True})
    with pytest.raises(openai.APIError, match="deadline"):
        list(stream)


def test_queue_full_is_429_with_retry_after(folder):
    s = Server(folder, "--max-batch", "1", "--max-queue", "0")      # one running request, none waiting
    try:
        c = s.client()

        def ask(_):
            try:
                return c.completions.create(model=MODEL, prompt="x", max_tokens=LONG, temperature=0,
                                            extra_body=spec("ar") | {"ignore_eos": True})
            except openai.RateLimitError as e:
                return e
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
        assert refused and len(refused) < 8
        body = refused[0].body
        assert refused[0].status_code == 429 and "max_queue 0" in body["message"] and body["code"] == "queue_full"
        assert refused[0].response.headers["retry-after"] == "1"
        assert all(a.usage.completion_tokens == LONG for a in answers if a not in refused)
    finally:
        assert s.stop() == 0


def test_api_key(folder):
    s = Server(folder, "--api-key", "sekrit")
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            s.client("wrong").completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert_error(e, 401, "API key")
        assert httpx.get(s.base + "/metrics").status_code == 401
        assert s.get("/health").status_code == 200            # the one open endpoint
        assert s.client("sekrit").completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    finally:
        assert s.stop() == 0


# ---------------------------------------------------------------------------------------------
# Disconnects, metrics, drain, load
# ---------------------------------------------------------------------------------------------

def wait_idle(server: Server, seconds: float = 10) -> dict:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        h = server.get("/health").json()
        if h["active"] == 0 and h["queued"] == 0:
            return h
        time.sleep(0.02)
    raise AssertionError(f"slots still busy: {h}")


def test_disconnect_mid_stream_frees_the_slot(server, folder):
    before = metric_values(server)
    with httpx.stream("POST", server.url + "/completions", timeout=60, json=dict(
            model=MODEL, prompt="x", max_tokens=LONG, temperature=0, stream=True, ignore_eos=True)) as r:
        lines = r.iter_lines()
        next(lines)
        assert server.get("/health").json()["active"] == 1
    t0 = time.monotonic()
    wait_idle(server)
    assert time.monotonic() - t0 < 5
    after = metric_values(server)
    key = ("trtspec_request_finish_total", (("reason", "cancelled"),))
    assert after.get(key, 0) == before.get(key, 0) + 1
    # A non-streaming request whose client gives up is cancelled too.
    with pytest.raises(openai.APITimeoutError):
        server.client().with_options(timeout=0.3).completions.create(
            model=MODEL, prompt="x", max_tokens=LONG, temperature=0, extra_body=spec("ar") | {"ignore_eos": True})
    wait_idle(server)
    assert metric_values(server).get(key, 0) == before.get(key, 0) + 2
    want = run_json(folder, PROMPTS[0], "chain", 16)
    got = server.client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                             extra_body=spec("chain"))
    assert got.choices[0].text == want["text"]


def test_metrics_match_what_was_sent(server):
    c = server.client()
    before = metric_values(server)
    for strategy in ("ar", "chain"):
        c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, extra_body=spec(strategy))
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=0)
    after = metric_values(server)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)
    assert delta("trtspec_requests_total", endpoint="/v1/completions", status="200") == 2
    assert delta("trtspec_requests_total", endpoint="/v1/completions", status="400") == 1
    assert delta("trtspec_generation_tokens_total") == 24
    assert delta("trtspec_request_finish_total", reason="length") == 2
    assert delta("trtspec_time_to_first_token_seconds_count") == 2
    drafts = delta("trtspec_spec_decode_num_drafts_total")
    accepted = delta("trtspec_spec_decode_num_accepted_tokens_total")
    assert drafts >= 1 and delta("trtspec_spec_decode_num_draft_tokens_total") == 4 * drafts   # chain k=4
    per_pos = sum(v - before.get(k, 0) for k, v in after.items()
                  if k[0] == "trtspec_spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == accepted
    assert after[("trtspec_slots", ())] == 4 and after[("trtspec_active_slots", ())] == 0
    assert after[("trtspec_queue_depth", ())] == 0


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_drains_running_requests(folder, sig):
    """SIGTERM (an orchestrator) or SIGINT (Ctrl-C): running requests finish, then exit 0. (The drain
    timeout is raised from its 30 s default: on a loaded 2-core machine the 4,000 tokens can take
    longer, and then the timeout rightly cuts the stream; that is not what this test is about.)"""
    s = Server(folder, "--max-batch", "2", "--drain-timeout", "300")
    c = s.client()
    stream = c.completions.create(model=MODEL, prompt="x", max_tokens=LONG, temperature=0, stream=True,
                                  stream_options={"include_usage": True}, extra_body=spec("ar") | {"ignore_eos": True})
    chunks = [next(iter(stream))]
    s.proc.send_signal(sig)
    chunks += list(stream)
    assert len(chunks) > 20, "the request ended before the signal; nothing was drained"
    assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == LONG
    assert s.proc.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.base + "/health", timeout=5)


def stream_or_leave(c: openai.OpenAI, prompt: str, strategy: str, max_tokens: int, leave: bool) -> str | None:
    """A streamed greedy completion's text; with `leave`, the client goes away after two chunks (None)."""
    stream = c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                  extra_body=spec(strategy))
    pieces = []
    for chunk in stream:
        pieces.append(chunk.choices[0].text)
        if leave and len(pieces) == 2:
            stream.close()
            return None
    return "".join(pieces)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads resident memory from /proc")
def test_load_with_random_disconnects(folder):
    """8 concurrent streaming clients, 200 requests, about 1 in 5 dropped mid-stream: every completed greedy
    answer equals its solo answer, memory is flat over the last 100 requests, all slots free at the end."""
    s = Server(folder, "--max-batch", "4", "--max-queue", "64")
    try:
        c = s.client()
        jobs = [(p, strat) for p in PROMPTS for strat in ("ar", "chain", "staged", "ngram")]
        solo = {job: c.completions.create(model=MODEL, prompt=job[0], max_tokens=24, temperature=0,
                                          extra_body=spec(job[1])).choices[0].text for job in jobs}
        rng = random.Random(0)
        plan = [(rng.choice(jobs), rng.random() < 0.2) for _ in range(200)]
        rss = {}

        def one(i: int):
            job, drop = plan[i]
            text = stream_or_leave(c, *job, max_tokens=24, leave=drop)
            return None if text is None else (job, text)

        results = []
        with ThreadPoolExecutor(8) as pool:
            for half in (range(100), range(100, 200)):
                results += list(pool.map(one, half))
                rss[half.stop] = rss_kib(s.proc.pid)
        done = [r for r in results if r is not None]
        assert len(done) >= 120
        assert all(text == solo[job] for job, text in done)
        print(f"resident KiB after 100 and 200 requests: {rss}, completed {len(done)}/200")
        assert rss[200] - rss[100] < 16 * 1024, rss
        wait_idle(s)
        errors = {k: v for k, v in metric_values(s).items() if k[0] == "trtspec_request_finish_total"
                  and k[1] == (("reason", "error"),)}
        assert not any(errors.values())
    finally:
        assert s.stop() == 0


def test_a_failing_request_is_an_error_object_and_the_next_one_runs(monkeypatch):
    """In-process (FastAPI's TestClient): a request whose generation raises gets a 500 error object (a
    final error event when streamed); the server and the next request are unaffected."""
    from conftest import make_pair
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from trtspec.runtime.generator import Generator
    from trtspec.serve.app import Service, make_app
    from trtspec.serve.worker import Worker

    class Boom(Exception):
        pass

    def broken(self, st):
        raise Boom("kaput")
        yield

    pair = make_pair()
    tok = AutoTokenizer.from_pretrained(str(ROOT / "trtspec" / "assets" / "tiny-tokenizer"))
    gen = Generator(pair.target_engine, pair.draft_engine, tokenizer=tok, capacity=256, slots=2)
    monkeypatch.setattr(STRATEGIES["chain"], "propose", broken)      # k=2: a fixed budget always drafts
    ask = {"model": MODEL, "prompt": "x", "max_tokens": 4, "temperature": 0}
    with TestClient(make_app(Service(Worker(gen, strategy="ar"), model=MODEL))) as client:
        r = client.post("/v1/completions", json=ask | spec("chain", k=2))
        assert r.status_code == 500 and "Boom: kaput" in r.json()["error"]["message"]
        assert r.headers["x-should-retry"] == "false"        # the openai client would run it again
        r = client.post("/v1/completions", json=ask | spec("chain", k=2) | {"stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "kaput" in json.loads(events[-2])["error"]["message"]
        r = client.post("/v1/completions", json=ask)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert client.get("/health").json()["active"] == 0


def test_operator_limits_what_clients_choose():
    """--allow-strategies and --timeout are the operator's: a client may not pick another strategy or
    a longer deadline, only a shorter one. A chat template that refuses the messages is a 400."""
    from conftest import make_pair
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from trtspec.runtime.generator import Generator
    from trtspec.serve.app import Service, make_app
    from trtspec.serve.worker import Worker

    pair = make_pair()
    tok = AutoTokenizer.from_pretrained(str(ROOT / "trtspec" / "assets" / "tiny-tokenizer"))
    tok.chat_template = "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}" \
                        "{% endif %}{{ m['content'] }}{% endfor %}"
    gen = Generator(pair.target_engine, pair.draft_engine, tokenizer=tok, capacity=256, slots=2)
    svc = Service(Worker(gen, strategy="ar", allowed=("ar", "ngram"), timeout=0.001), model=MODEL)
    ask = {"model": MODEL, "prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    with TestClient(make_app(svc)) as client:
        r = client.post("/v1/completions", json=ask | spec("staged"))
        assert r.status_code == 400 and "not enabled" in r.json()["error"]["message"]
        r = client.post("/v1/completions", json=ask | {"timeout": 60})         # longer than the server's
        assert r.status_code == 408 and r.headers["x-should-retry"] == "false"
        assert client.get("/version").json()["strategies"] == ["ar", "ngram"]
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "no system" in r.json()["error"]["message"]   # developer -> system
        assert r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("history", ["shared", "user", "off"])
def test_suffix_history_per_user_or_off(history):
    """--history: what a request's suffix drafts may learn from. shared: the config's scope; user: one
    trie per OpenAI `user` (named by a digest), none for a request without one; off: none at all."""
    from conftest import make_pair
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from trtspec.runtime.drafters import suffix
    from trtspec.runtime.generator import Generator
    from trtspec.serve.app import Service, make_app
    from trtspec.serve.jobs import history_scope
    from trtspec.serve.worker import Worker

    pair = make_pair()
    tok = AutoTokenizer.from_pretrained(str(ROOT / "trtspec" / "assets" / "tiny-tokenizer"))
    gen = Generator(pair.target_engine, pair.draft_engine, tokenizer=tok, capacity=256, slots=2)
    suffix.forget()
    ask = {"model": MODEL, "prompt": "x y", "max_tokens": 6, "temperature": 0, "ignore_eos": True} | spec("suffix")
    with TestClient(make_app(Service(Worker(gen, strategy="ar", history=history), model=MODEL))) as client:
        for user in ("alice", "bob", None):
            r = client.post("/v1/completions", json=ask | ({"user": user} if user else {}))
            assert r.status_code == 200
    scopes = sorted(key[0] for key, st in suffix._STORES.items() if len(st))
    expect = {"shared": ["default"], "user": sorted(history_scope("user", u) for u in ("alice", "bob")),
              "off": []}[history]
    assert scopes == expect and all("alice" not in s and "bob" not in s for s in scopes)
    suffix.forget()
    gen.close()


def test_global_tries_are_bounded_in_number(monkeypatch):
    from trtspec.runtime.drafters import suffix
    suffix.forget()
    monkeypatch.setattr(suffix, "MAX_SCOPES", 3)
    first = suffix.store("s0", 8, 16, 1000)
    for i in range(1, 5):
        suffix.store(f"s{i}", 8, 16, 1000)
        suffix.store("s1", 8, 16, 1000)           # used again: kept
    assert sorted(k[0] for k in suffix._STORES) == ["s1", "s3", "s4"]
    assert suffix.store("s0", 8, 16, 1000) is not first    # forgotten: a new, empty one
    suffix.forget()


def test_busy_port_is_one_line_before_loading(server, folder):
    port = server.base.rsplit(":", 1)[1]
    res = subprocess.run([sys.executable, "-m", "trtspec.cli", "serve", "--engines", str(folder), "--port", port],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in res.stderr and "loading" not in res.stderr


# ---- the server against its own OpenAPI schema; request bodies --------------------------------------

@pytest.mark.slow
def test_schema_is_true_to_the_server(server, tmp_path):
    """schemathesis (every operation, every documented field, random and boundary values, all its
    checks) against the real server: no 500, no hang, every response (errors included) as documented.
    positive_data_acceptance is left out: a schema-valid request can still be refused for what a
    schema cannot say (prompt tokens + max_tokens over the KV capacity, stream_options without stream).
    A response may take up to 100 s (a long generation on a loaded 2-core machine: schemathesis's
    own 10 s limit failed once, at 10.6 s, with three test workers on two cores); a hang fails."""
    proc = subprocess.run([str(Path(sys.executable).with_name("schemathesis")), "run", f"{server.base}/openapi.json",
                           "--checks", "all", "--exclude-checks", "positive_data_acceptance", "--max-examples", "15",
                           "--seed", "1", "--workers", "1", "--request-timeout", "120", "--max-response-time", "100",
                           "--no-color"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)   # its cache goes there
    summary = proc.stdout[proc.stdout.find("SUMMARY"):]
    assert proc.returncode == 0, proc.stdout[-6000:]
    m = re.search(r"(\d+) generated, (\d+) passed", summary)
    assert m and int(m.group(1)) == int(m.group(2)) > 100, summary


def test_schema_documents_errors_and_metrics_as_served(server):
    schema = server.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and {"400", "401", "404", "408", "413", "429", "503"} <= set(responses)
        assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert "text/event-stream" in responses["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert server.get("/metrics").headers["content-type"].startswith("text/plain")
    r = httpx.post(f"{server.url}/completions", content=b"\xff\xfe{", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def small_body_server(folder):
    s = Server(folder, "--max-body-mb", "0.01", "--body-timeout", "2", "--max-batch", "1")
    yield s
    assert s.stop() == 0, "".join(s.log)


def test_a_body_over_the_limit_is_413_before_it_is_read(small_body_server):
    s = small_body_server
    ask = {"model": MODEL, "prompt": "x" * 20000, "max_tokens": 2}
    r = httpx.post(f"{s.url}/completions", json=ask, timeout=30)            # by its Content-Length
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():                                                           # no Content-Length: as it arrives
        yield b'{"model": "tiny-random", "prompt": "'
        for _ in range(20):
            yield b"x" * 1000
        yield b'"}'
    r = httpx.post(f"{s.url}/completions", content=chunks(), timeout=30, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(f"{s.url}/completions", json=ask | {"prompt": "def f(x):"}, timeout=30)
    assert r.status_code == 200


def test_a_slow_body_holds_no_slot_and_times_out(small_body_server):
    """A client that sends its body byte by byte holds a connection, never the one slot: another
    request is served meanwhile, and the slow one gets 408 once --body-timeout passes."""
    import socket
    s = small_body_server
    host, port = s.base.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": "def f(x):", "max_tokens": 2}).encode()
    slow = socket.create_connection((host, int(port)), timeout=30)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
    t0 = time.monotonic()
    r = httpx.post(f"{s.url}/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and time.monotonic() - t0 < 2
    assert s.get("/health").json()["active"] == 0
    for b in body[5:8]:                                  # still trickling: the deadline counts from the start
        slow.sendall(bytes([b]))
        time.sleep(0.3)
    reply = b""
    while b"body_timeout" not in reply and (chunk := slow.recv(4096)):   # headers and body may come apart
        reply += chunk
    slow.close()
    assert reply.decode().startswith("HTTP/1.1 408") and b"body_timeout" in reply
