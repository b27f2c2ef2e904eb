"""Autoscaling by hand (docs/benchmarks.md, "On Ray Serve"): tiny folder, --min-replicas 1
--max-replicas 2 --target-ongoing-requests 1; 4 clients for 40 s, then 1 for 120 s; prints
(seconds, phase, clients, replicas reporting, active slots) each second, and every answer is
checked against the first. The folder: the tiny-random config with max_seq_len 4096, built with
trtspec.assembly.build.build_engines to /tmp/tiny4k (as tests/e2e/test_serve.py's fixture does).
Run from the repository: python lab/bench/ray-serve/autoscale.py"""
import json, signal, subprocess, sys, threading, time
import httpx
port = 8130
proc = subprocess.Popen([sys.executable, "-m", "trtspec.cli", "serve", "--engines", "/tmp/tiny4k", "--port", str(port),
                         "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "1",
                         "--max-batch", "2", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
for line in proc.stdout:
    print(line, end="")
    if "serving on" in line: break
threading.Thread(target=lambda: [None for l in proc.stdout], daemon=True).start()
base = f"http://127.0.0.1:{port}"
want = None
stop = threading.Event(); clients = [4]
log = []; errors = []; done = [0]; replicas_seen = set()
def client(k):
    global want
    while not stop.is_set():
        if k >= clients[0]:
            time.sleep(0.2); continue
        r = httpx.post(base + "/v1/completions", json={"model": "tiny-random", "prompt": "x", "max_tokens": 1500,
                        "temperature": 0, "ignore_eos": True, "speculative": {"strategy": "ar"}}, timeout=120)
        if r.status_code != 200:
            errors.append((r.status_code, r.text[:200])); continue
        text = r.json()["choices"][0]["text"]
        want = want or text
        if text != want: errors.append(("differs", k))
        done[0] += 1; replicas_seen.add(r.headers["x-trtspec-replica"])
threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(4)]
for t in threads: t.start()
t0 = time.time()
def phase(name, seconds):
    end = time.time() + seconds
    while time.time() < end:
        h = httpx.get(base + "/health").json()
        log.append((round(time.time() - t0, 1), name, clients[0], h["replicas"], h["active"]))
        time.sleep(1)
phase("4 clients", 40)
clients[0] = 1
phase("1 client", 120)
stop.set()
for t in threads: t.join(130)
for row in log: print(row)
print("completed", done[0], "errors", errors, "replicas seen", len(replicas_seen))
proc.send_signal(signal.SIGTERM)
print("exit", proc.wait(90))
