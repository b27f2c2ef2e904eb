"""Overload, soak and drain against a running `trtspec serve`, every answer checked.

    trtspec serve --engines ENGINES --max-batch 4 --max-queue 8 &
    python -m trtspec.tools.bench_serve --overload 600 --clients 16 --output docs/bench/overload

A catalogue of chat requests ("kinds") is made from the dataset's prompts: streamed and not, greedy
and seeded sampled, `n = 2`, a JSON schema, stop strings, and two long prompts (about a quarter of
--long-tokens and all of it). Every kind is deterministic (greedy, or sampled with its seed), so each
has one right answer. The tool first sends each kind alone (its solo answer), then --clients
closed-loop clients send kinds drawn at random for SECONDS; a --cancel share of the streams leave
after two chunks. A 429 must carry Retry-After; that client waits as long, then goes on. Once a
minute a prompt longer than the context is sent beside the load: it must be a 400.

Checked (exit 1 if any fails): no request failed (a status other than 200 / 429, a timeout, a
broken connection, an error event, a stream that ends without [DONE]); every completed answer equals
its solo answer (greedy: the batch changed nothing; seeded: it changed no draw); afterwards no slot
is held and none waits. Measured: requests completed, rejected, cancelled; TTFT (streams) and
latency p50 / p95 / p99; tokens/s; the speculation counters over the run (/metrics); and every
--sample-every seconds the server's resident memory, open files, threads and prefix-cache blocks
(its /metrics), whose change after the first minute is reported against a 5% goal.

--drain-after T --server-pid PID sends the server (on this machine) SIGTERM T seconds in: the
requests in flight must still finish and equal their solo answers, later ones are refused (503, or
the connection refused once the socket closes), and the seconds the server took to exit are reported.
Writes overload.json, overload.md and overload.png to --output.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from .bench_concurrency import _pct
from .datasets import load_prompts

MODES = ("greedy", "sampled", "n2", "json", "stop")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "lines": {"type": "integer"}},
          "required": ["name", "lines"], "additionalProperties": False}
FLAT = 0.05                             # the soak's goal: within 5% after the warm-up (a minute)
SAMPLED = {"process_resident_memory_bytes": "rss_bytes", "process_open_fds": "open_fds",
           "trtspec_process_threads": "threads", "trtspec_prefix_cache_blocks": "prefix_blocks",
           "trtspec_active_slots": "active", "trtspec_queue_depth": "queued"}
SPEC = ("trtspec_spec_decode_num_drafts_total", "trtspec_spec_decode_num_draft_tokens_total",
        "trtspec_spec_decode_num_accepted_tokens_total", "trtspec_generation_tokens_total",
        "trtspec_prefix_cache_hits_total", "trtspec_prefix_cache_queries_total",
        "trtspec_request_finish_total{reason=error}", "trtspec_request_finish_total{reason=cancelled}")


@dataclass(frozen=True)
class Kind:
    name: str
    body: dict                          # the chat request, without `model`

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def catalogue(prompts, max_tokens: int, long_tokens: int, strategy: str | None = None) -> list[Kind]:
    """Every mode streamed and not (over the first 2 x len(MODES) prompts), then two long prompts;
    each asks for `strategy` (None: the server's default)."""
    kinds = []
    for i, p in enumerate(prompts):
        mode, stream = MODES[i % len(MODES)], (i // len(MODES)) % 2 == 0
        ask = p.messages or [{"role": "user", "content": "Complete this Python function.\n\n" + p.text}]
        kinds.append(Kind(f"{i}-{mode}-{'stream' if stream else 'json'}", _body(ask, mode, stream, max_tokens, i)))
    blob = "\n\n".join(p.text or p.messages[0]["content"] for p in prompts)
    for j, tokens in enumerate(t for t in (long_tokens // 4, long_tokens) if t > 0):
        text = (blob * (1 + 3 * tokens // max(1, len(blob))))[:3 * tokens]      # about 3 characters a token
        ask = [{"role": "user", "content": text + "\n\nWhat does the last function above do? One sentence."}]
        kinds.append(Kind(f"long{j}-greedy-{'stream' if j % 2 else 'json'}",
                          _body(ask, "greedy", j % 2 == 1, max_tokens, 100 + j)))
    if strategy:
        kinds = [Kind(k.name, {**k.body, "speculative": {"strategy": strategy}}) for k in kinds]
    return kinds


def _body(messages, mode: str, stream: bool, max_tokens: int, seed: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if mode in ("sampled", "n2"):
        body |= {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + seed} | ({"n": 2} if mode == "n2" else {})
    if mode == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA}}
    if mode == "stop":
        body["stop"] = ["return", "\n\n\n"]            # cut mid-answer (a chat answer opens with ```)
    return body


def send(client: httpx.Client, url: str, body: dict, leave_after: int | None = None) -> dict:
    """One chat request: its status (an int, or cancelled / refused / timeout / broken / cut /
    error_event), texts by choice, tokens, TTFT (streams) and latency."""
    rec, t0 = {"t0": time.perf_counter(), "texts": None, "tokens": 0, "ttft": None}, time.perf_counter()
    try:
        if body.get("stream"):
            with client.stream("POST", url, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    rec |= _refused(r)
                else:
                    rec |= _streamed(r, leave_after, t0)
        else:
            r = client.post(url, json=body)
            if r.status_code == 200:
                data = r.json()
                choices = sorted(data["choices"], key=lambda c: c["index"])
                rec |= {"status": 200, "texts": [c["message"]["content"] for c in choices],
                        "tokens": data["usage"]["completion_tokens"], "prompt_tokens": data["usage"]["prompt_tokens"]}
            else:
                rec |= _refused(r)
    except httpx.ConnectError:
        rec["status"] = "refused"
    except httpx.TimeoutException:
        rec["status"] = "timeout"
    except httpx.HTTPError as e:
        rec |= {"status": "broken", "error": f"{type(e).__name__}: {e}"}
    rec["latency"] = time.perf_counter() - t0
    return rec


def _refused(r: httpx.Response) -> dict:
    try:
        error = r.json()["error"]
        message, code = error["message"], error["code"]
    except (ValueError, KeyError, TypeError):
        message, code = r.text[:200], None
    return {"status": r.status_code, "error": message, "code": code, "retry_after": r.headers.get("retry-after")}


def _streamed(r: httpx.Response, leave_after: int | None, t0: float) -> dict:
    texts: dict[int, str] = {}
    out, chunks = {"status": "cut"}, 0
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            out["status"] = "error_event" if "error" in out else 200
            break
        event = json.loads(line[6:])
        if "error" in event:
            out |= {"error": event["error"]["message"], "code": event["error"].get("code")}
            continue
        if event.get("usage"):
            out |= {"tokens": event["usage"]["completion_tokens"], "prompt_tokens": event["usage"]["prompt_tokens"]}
        for choice in event["choices"]:
            piece = choice["delta"].get("content")
            if piece:
                out.setdefault("ttft", time.perf_counter() - t0)
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
                chunks += 1
        if leave_after is not None and chunks >= leave_after:
            return {"status": "cancelled"}                 # leaving the `with` closes the connection
    return out | {"texts": [texts.get(i, "") for i in range(max(texts, default=-1) + 1)]}


def scrape(base: str, headers: dict | None = None) -> dict[str, float]:
    """/metrics as {name: value summed over labels (models, replicas)} and {name{label=value}: value
    summed over replicas}; {} if it does not answer."""
    try:
        text = httpx.get(base + "/metrics", timeout=10, headers=headers).raise_for_status().text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "replica")
            if labels:
                key = f"{s.name}{{{labels}}}"
                out[key] = out.get(key, 0.0) + s.value
    return out


@dataclass
class Load:
    """One overload run: where, how long, how many clients, what they do."""
    base: str                           # http://HOST:PORT of the server
    model: str
    seconds: float
    clients: int
    cancel: float = 0.1                 # share of streams that leave after two chunks
    sample_every: float = 30.0
    timeout: float = 600.0              # one request's read timeout, seconds
    drain_after: float | None = None
    server_pid: int | None = None
    seed: int = 0
    warm_s: float = 60.0                # the soak's numbers count from here
    kill_after: float | None = None     # SIGKILL `kill_pid` (a Ray replica) this long into the load
    kill_pid: int | None = None
    api_key: str = "none"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def url(self) -> str:
        return self.base + "/v1/chat/completions"


def solo_answers(load: Load, kinds: list[Kind], log=print) -> dict[str, dict]:
    """Each kind alone, one after another: the answers the load must reproduce."""
    out = {}
    with httpx.Client(timeout=httpx.Timeout(load.timeout, connect=10), headers=load.headers) as client:
        for i, k in enumerate(kinds):
            rec = send(client, load.url, {"model": load.model, **k.body})
            if rec["status"] != 200:
                raise SystemExit(f"the solo request {k.name} got {rec['status']} ({rec.get('error', '')}); "
                                 "every kind must succeed alone before the load starts")
            out[k.name] = rec | {"sampled": k.body["temperature"] > 0}
            log(f"solo {i + 1}/{len(kinds)} {k.name}: {rec.get('prompt_tokens', '?')} prompt tokens, "
                f"{rec['tokens']} new, {rec['latency']:.1f}s")
    return out


def too_long(load: Load, capacity: int) -> dict:
    """A chat request whose prompt alone is over the context (the server must answer 400)."""
    return {"model": load.model, "max_tokens": 16, "messages": [{"role": "user", "content": "hello " * (capacity + capacity // 4)}]}


def overload(load: Load, kinds: list[Kind], capacity: int, log=print) -> dict:
    """The load itself: records of every request, the long-prompt probes, /metrics samples, the drain."""
    records: list[dict] = []
    samples: list[dict] = []
    probes: list[dict] = []
    drain: dict = {}
    kill: dict = {}
    stop = threading.Event()
    t_start = time.perf_counter()
    deadline = t_start + load.seconds

    def client(i: int) -> None:
        rng = random.Random(load.seed * 1_000_003 + i)
        with httpx.Client(timeout=httpx.Timeout(load.timeout, connect=10), headers=load.headers) as c:
            while time.perf_counter() < deadline and not stop.is_set():
                kind = rng.choice(kinds)
                leave = 2 if kind.stream and rng.random() < load.cancel else None
                rec = send(c, load.url, {"model": load.model, **kind.body}, leave)
                records.append(rec | {"kind": kind.name, "client": i})
                if rec["status"] == 429:
                    stop.wait(min(float(rec.get("retry_after") or 1), 5.0))
                elif rec["status"] in (503, "refused") and drain:
                    return                                   # the server is going away

    def sampler() -> None:
        while True:
            sample(samples, load, t_start, records)
            if stop.wait(load.sample_every):
                return

    def prober() -> None:
        with httpx.Client(timeout=120, headers=load.headers) as c:
            while not stop.wait(min(60.0, load.seconds / 2)) and time.perf_counter() < deadline and not drain:
                probes.append(send(c, load.url, too_long(load, capacity)))

    def drainer() -> None:
        if load.drain_after is None or stop.wait(load.drain_after):
            return
        drain["metrics"] = scrape(load.base, load.headers)   # the counters as the drain begins
        drain["t"] = time.perf_counter()
        os.kill(load.server_pid, signal.SIGTERM)
        while _alive(load.server_pid) and time.perf_counter() - drain["t"] < load.timeout:
            time.sleep(0.1)
        drain["exit_s"] = time.perf_counter() - drain["t"] if not _alive(load.server_pid) else None

    def killer() -> None:
        if load.kill_after is None or stop.wait(load.kill_after):
            return
        kill["t"] = time.perf_counter()
        os.kill(load.kill_pid, signal.SIGKILL)

    helpers = [threading.Thread(target=f, daemon=True) for f in (sampler, prober, drainer, killer)]
    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(load.clients)]
    for t in helpers + clients:
        t.start()
    with tqdm(total=int(load.seconds), unit="s", desc="overload", mininterval=1 if sys.stderr.isatty() else 30,
              disable=log is None) as bar:
        while any(t.is_alive() for t in clients):
            time.sleep(1)
            bar.n = min(int(time.perf_counter() - t_start), bar.total)
            bar.set_postfix_str(_tally(records), refresh=False)
            bar.update(0)
    wall = time.perf_counter() - t_start
    stop.set()
    for t in helpers:
        t.join()
    return {"records": records, "samples": samples, "probes": probes, "drain": drain, "kill": kill, "wall_s": wall,
            "t_start": t_start, "warm_s": load.warm_s}


def _tally(records: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in list(records):
        key = {200: "completed", 429: "rejected"}.get(r["status"], str(r["status"]))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def sample(samples: list[dict], load: Load, t_start: float, records: list[dict]) -> None:
    m = scrape(load.base, load.headers)
    if m:
        samples.append({"t": time.perf_counter() - t_start, "completed": sum(r["status"] == 200 for r in list(records)),
                        **{short: m.get(name) for name, short in SAMPLED.items()}})


def _alive(pid: int) -> bool:
    """Whether `pid` still runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_idle(base: str, seconds: float = 120.0) -> dict:
    """/health once nothing runs or waits (or the last answer after `seconds`)."""
    deadline, health = time.monotonic() + seconds, {}
    while time.monotonic() < deadline:
        try:
            health = httpx.get(base + "/health", timeout=10).json()
        except httpx.HTTPError:
            return {}
        if health.get("active") == 0 and health.get("queued") == 0:
            break
        time.sleep(0.2)
    return health


def summarize(run: dict, solo: dict[str, dict], before: dict, after: dict, idle: dict) -> dict:
    """Counts, latencies, speculation and soak numbers of one run, and the checks it passed."""
    records, t_sig = run["records"], run["drain"].get("t")
    t_kill = run["kill"].get("t")
    by: dict[str, list[dict]] = {"completed": [], "rejected": [], "cancelled": [], "drained": [], "replica_failed": [],
                                 "failed": []}
    for r in records:
        if r["status"] == 200:
            by["completed"].append(r)
        elif r["status"] == 429:
            by["rejected"].append(r)
        elif r["status"] == "cancelled":
            by["cancelled"].append(r)
        elif t_sig is not None and (r["status"] in (503, "refused") and r["t0"] + r["latency"] >= t_sig
                                    or r["status"] == "broken" and r["t0"] >= t_sig):   # sent to a closing server
            by["drained"].append(r)
        elif t_kill is not None and r.get("code") == "replica_failed" and r["t0"] + r["latency"] >= t_kill:
            by["replica_failed"].append(r)                  # ended by the replica killed under it: retryable
        else:
            by["failed"].append(r)
    done = by["completed"]
    differ = [r for r in done if r["texts"] != solo[r["kind"]]["texts"]]
    tokens = sum(r["tokens"] for r in done)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SPEC}
    drafts = delta["trtspec_spec_decode_num_drafts_total"]
    out = {"requests": len(records), **{k: len(v) for k, v in by.items()}, "differ_from_solo": len(differ),
           "kinds_completed": len({r["kind"] for r in done}), "completion_tokens": tokens,
           "tokens_per_s": tokens / run["wall_s"], "wall_s": run["wall_s"],
           "rejected_without_retry_after": sum(not r.get("retry_after") for r in by["rejected"]),
           "greedy_completed": sum(solo[r["kind"]].get("sampled") is False for r in done),
           "seeded_completed": sum(bool(solo[r["kind"]].get("sampled")) for r in done),
           "probes": len(run["probes"]), "probes_400": sum(p["status"] == 400 for p in run["probes"]),
           "probe_answers": [f"{p['status']} {p.get('code')}" for p in run["probes"]],
           "spec": {"drafts": drafts, "draft_tokens": delta["trtspec_spec_decode_num_draft_tokens_total"],
                    "accepted": delta["trtspec_spec_decode_num_accepted_tokens_total"],
                    "mean_accepted_length": 1 + delta["trtspec_spec_decode_num_accepted_tokens_total"] / drafts
                    if drafts else None,
                    "prefix_hit_tokens": delta["trtspec_prefix_cache_hits_total"],
                    "prefix_queried_tokens": delta["trtspec_prefix_cache_queries_total"]},
           "server_errors": delta["trtspec_request_finish_total{reason=error}"],
           "server_cancelled": delta["trtspec_request_finish_total{reason=cancelled}"],
           "idle": idle, "soak": flatness(run["samples"], run["warm_s"], before, after if idle else {}),
           "failures": [{k: r.get(k) for k in ("kind", "status", "error", "code")} for r in by["failed"][:20]],
           "differences": [r["kind"] for r in differ[:20]]}
    for key, xs in (("ttft", [r["ttft"] for r in done if r.get("ttft") is not None]),
                    ("latency", [r["latency"] for r in done])):
        out |= {f"{key}_p{q}_s": _pct(xs, q) for q in (50, 95, 99)}
    if t_kill is not None:
        out["kill"] = {"at_s": t_kill - run["t_start"]}
    if t_sig is not None:
        in_flight = [r for r in records if r["t0"] < t_sig < r["t0"] + r["latency"]]
        out["drain"] = {"at_s": t_sig - run["t_start"], "in_flight": len(in_flight),
                        "in_flight_completed": sum(r["status"] == 200 for r in in_flight),
                        "in_flight_cancelled_by_client": sum(r["status"] == "cancelled" for r in in_flight),
                        "refused_after": len(by["drained"]), "exit_s": run["drain"].get("exit_s")}
    out["checks"] = checks(out, t_sig is not None)
    return out


def checks(s: dict, drained: bool) -> dict[str, bool]:
    c = {"no request failed": s["failed"] == 0 and s["server_errors"] == 0,
         "every completed answer equals its solo answer": s["differ_from_solo"] == 0,
         "every 429 carries Retry-After": s["rejected_without_retry_after"] == 0,
         "a prompt over the context is a 400 beside the load": s["probes_400"] == s["probes"]}
    if drained:
        c["the server exited after SIGTERM"] = s["drain"]["exit_s"] is not None
    else:
        c["afterwards no slot is held and none waits"] = s["idle"].get("active") == 0 and s["idle"].get("queued") == 0
    return c


def flatness(samples: list[dict], warm_s: float, before: dict, after: dict) -> dict:
    """Each sampled gauge after `warm_s` seconds into the load: its first, last, least and largest
    values, its largest change from the first as a share, and its values with the server idle before
    and after the load. The soak's goal: resident memory within FLAT under load; open files and
    threads (which rise and fall with the connections and steps of the moment) back to within FLAT
    of where they were once the server is idle again."""
    warm = [s for s in samples if s["t"] >= warm_s]
    out = {}
    for name, key in SAMPLED.items():
        vals = [s[key] for s in warm if s.get(key) is not None]
        if len(vals) < 2 or key in ("active", "queued"):
            continue
        change = max(abs(v - vals[0]) for v in vals) / vals[0] if vals[0] else None
        rec = {"first": vals[0], "last": vals[-1], "min": min(vals), "max": max(vals), "change": change,
               "idle_before": before.get(name), "idle_after": after.get(name)}
        if key == "rss_bytes":
            rec["within_goal"] = change is not None and change <= FLAT
        elif key in ("open_fds", "threads") and after.get(name) is not None and before.get(name):
            rec["within_goal"] = after[name] <= before[name] * (1 + FLAT)
        out[key] = rec
    return out


def write_report(summary: dict, run: dict, solo: dict, settings: dict, output: Path) -> None:
    output.mkdir(parents=True, exist_ok=True)
    kinds = {name: {"prompt_tokens": r.get("prompt_tokens"), "tokens": r["tokens"], "latency_s": r["latency"]}
             for name, r in solo.items()}
    records = [{k: round(v, 4) if isinstance(v, float) else v for k, v in (r | {"t0": r["t0"] - run["t_start"]}).items()
                if k != "texts" and not (k == "error" and r["status"] == 429)} for r in run["records"]]
    head = json.dumps({"settings": settings, "summary": summary, "kinds": kinds, "samples": run["samples"]}, indent=1)
    (output / "overload.json").write_text(head[:-2] + ',\n "records": [\n  ' +       # a request a line
                                          ",\n  ".join(json.dumps(r) for r in records) + "\n ]\n}\n")
    s, ms = summary, lambda x: f"{x:.2f}"
    lines = [f"# {settings['title']}", "",
             "| requests | completed | rejected (429) | cancelled by the client | failed | = solo | tok/s |",
             "|---|---|---|---|---|---|---|",
             f"| {s['requests']} | {s['completed']} | {s['rejected']} | {s['cancelled']} | {s['failed']} | "
             f"{s['completed'] - s['differ_from_solo']}/{s['completed']} | {s['tokens_per_s']:.2f} |", "",
             f"TTFT p50 / p95 / p99: {ms(s['ttft_p50_s'])} / {ms(s['ttft_p95_s'])} / {ms(s['ttft_p99_s'])} s; "
             f"latency {ms(s['latency_p50_s'])} / {ms(s['latency_p95_s'])} / {ms(s['latency_p99_s'])} s. "
             f"Greedy completed {s['greedy_completed']}, seeded sampled {s['seeded_completed']}; "
             f"{s['kinds_completed']} of {len(solo)} kinds.", ""]
    sp = s["spec"]
    if sp["drafts"]:
        lines.append(f"Speculation under load: {sp['drafts']:.0f} target steps verified drafts, "
                     f"{sp['accepted']:.0f} of {sp['draft_tokens']:.0f} drafted tokens accepted, "
                     f"mean accepted length {sp['mean_accepted_length']:.2f}. ")
    if sp["prefix_queried_tokens"]:
        lines.append(f"Prefix cache: {sp['prefix_hit_tokens']:.0f} of {sp['prefix_queried_tokens']:.0f} prompt "
                     "tokens found.")
    if s["soak"]:
        lines += ["", f"| under load, from {run['warm_s']:g} s | first | last | min | max | largest change | idle before "
                      "| idle after | goal (5%) |", "|---|---|---|---|---|---|---|---|---|"]
    for key, v in s["soak"].items():
        change = f"{100 * v['change']:.1f}%" if v["change"] is not None else "–"
        goal = {True: "met", False: "missed"}.get(v.get("within_goal"), "–")
        unit, scale = (" (MiB)", 2**20) if key == "rss_bytes" else ("", 1)
        val = lambda k: f"{v[k] / scale:.0f}" if v[k] is not None else "–"        # noqa: E731
        lines.append(f"| {key.removesuffix('_bytes')}{unit} | {val('first')} | {val('last')} | {val('min')} | "
                     f"{val('max')} | {change} | {val('idle_before')} | {val('idle_after')} | {goal} |")
    if "kill" in s:
        lines += ["", f"SIGKILL of pid {settings['kill_pid']} at {s['kill']['at_s']:.0f} s: {s['replica_failed']} "
                      "answers ended with a retryable 503 replica_failed; every other request as above."]
    if "drain" in s:
        d = s["drain"]
        exit_s = f"{d['exit_s']:.1f} s after it" if d["exit_s"] is not None else "not within the timeout"
        lines += ["", f"SIGTERM at {d['at_s']:.0f} s: {d['in_flight']} requests in flight, {d['in_flight_completed']} "
                      f"completed, {d['in_flight_cancelled_by_client']} left by their clients; {d['refused_after']} "
                      f"refused after it; the server exited {exit_s}."]
    lines += ["", *(f"- {'passed' if ok else 'FAILED'}: {name}" for name, ok in s["checks"].items())]
    (output / "overload.md").write_text("\n".join(lines) + "\n")
    plot(run["samples"], output / "overload.png", settings["title"], run["warm_s"])


def plot(samples: list[dict], path: Path, title: str, warm_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    t = [s["t"] for s in samples]
    panels = [("rss_bytes", "resident memory (MiB)", 1 / 2**20), ("open_fds", "open files", 1),
              ("threads", "threads", 1), ("completed", "requests completed", 1)]
    for ax, (key, label, scale) in zip(axes.flat, panels):
        ax.plot(t, [(s.get(key) or 0) * scale for s in samples], marker=".")
        ax.set_ylabel(label)
        ax.axvline(warm_s, color="grey", lw=0.5)
        ax.set_ylim(bottom=0)
    for ax in axes[1]:
        ax.set_xlabel("seconds into the load")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p) -> None:
    g = p.add_argument_group("overload (--overload SECONDS; the module docstring says what it checks)")
    g.add_argument("--overload", type=float, default=None, metavar="SECONDS",
                   help="run the overload, soak and drain checks for SECONDS instead of the concurrency sweep")
    g.add_argument("--clients", type=int, default=16, help="concurrent clients (4 x the server's slots overloads it)")
    g.add_argument("--cancel", type=float, default=0.1, help="share of streams that leave after two chunks")
    g.add_argument("--long-tokens", type=int, default=4000, help="the longest prompt, about (0: none)")
    g.add_argument("--sample-every", type=float, default=30.0, help="seconds between /metrics samples")
    g.add_argument("--timeout", type=float, default=600.0, help="one request's read timeout, seconds")
    g.add_argument("--drain-after", type=float, default=None, metavar="SECONDS",
                   help="send the server SIGTERM this long into the load (needs --server-pid)")
    g.add_argument("--server-pid", type=int, default=None, help="the server's process id (on this machine)")
    g.add_argument("--kill-after", type=float, default=None, metavar="SECONDS",
                   help="SIGKILL --kill-pid (a Ray Serve replica) this long into the load")
    g.add_argument("--kill-pid", type=int, default=None, help="the process to kill (on this machine)")
    g.add_argument("--warm", type=float, default=60.0, metavar="SECONDS",
                   help="the soak's changes count from this many seconds into the load")
    g.add_argument("--strategy", default=None, help="the strategy every request asks for (default: the server's)")
    g.add_argument("--seed", type=int, default=0)


def main(a, log=print) -> int:
    """The overload run from bench_serve's parsed arguments; 0 if every check passed, else 1."""
    if a.drain_after is not None and a.server_pid is None:
        raise SystemExit("--drain-after needs --server-pid: the server to send SIGTERM to, on this machine")
    if a.kill_after is not None and a.kill_pid is None:
        raise SystemExit("--kill-after needs --kill-pid: the process (a Ray Serve replica) to kill, on this machine")
    base = a.url.rstrip("/").removesuffix("/v1")
    try:
        card = httpx.get(base + "/v1/models", timeout=30, headers={"Authorization": f"Bearer {a.api_key}"}).json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        raise SystemExit(f"no trtspec server answers at {a.url}; start one (trtspec serve) or pass --url") from None
    load = Load(base, card["id"], a.overload, a.clients, a.cancel, a.sample_every, a.timeout, a.drain_after,
                a.server_pid, a.seed, a.warm, a.kill_after, a.kill_pid, a.api_key)
    kinds = catalogue(load_prompts(a.dataset, limit=a.limit, stride=a.stride), a.max_tokens, a.long_tokens, a.strategy)
    solo = solo_answers(load, kinds, log)
    before = scrape(base, load.headers)
    run = overload(load, kinds, card["max_model_len"], log)
    idle = wait_idle(base) if a.drain_after is None else {}
    after = scrape(base, load.headers) if a.drain_after is None else run["drain"].get("metrics", {})
    summary = summarize(run, solo, before, after or before, idle)
    settings = {"url": a.url, "model": load.model, "dataset": a.dataset, "limit": a.limit, "seconds": a.overload,
                "clients": a.clients, "cancel": a.cancel, "max_tokens": a.max_tokens, "long_tokens": a.long_tokens,
                "strategy": a.strategy, "drain_after": a.drain_after, "kill_after": a.kill_after, "kill_pid": a.kill_pid, "date": time.strftime("%Y-%m-%d"),
                "title": a.title or f"trtspec serve under overload: {load.model}, {a.clients} clients, {a.overload:g} s"}
    write_report(summary, run, solo, settings, a.output)
    log((a.output / "overload.md").read_text())
    return 0 if all(summary["checks"].values()) else 1
