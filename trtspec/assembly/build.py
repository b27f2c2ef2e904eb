"""`trtspec build`: config -> engine folder.

    DIR/manifest.json                config, specs, I/O contract, versions, sha256 of every file
    DIR/tokenizer/                   tokenizer files (the target's; the draft's must match)
    DIR/{target,draft}/weights.safetensors   torch engine (dequantized, in the config dtype)
    DIR/{target,draft}/model.{dtype}.onnx    the step contract as ONNX (onnxruntime / tensorrt)
    DIR/{target,draft}/model.{dtype}.ort.onnx  ONNX Runtime-optimized graph
    DIR/{target,draft}/model.fp32-{int4,int8,gguf}[.ort].onnx  the same, weight-only (`quantize:`)
    DIR/{target,draft}/model.{dtype}.plan    TensorRT plan (backend tensorrt: needs TensorRT and a GPU)
    DIR/NAME/head.safetensors        a head role (`heads:`; export/head.py), checked against the target

What is built follows the backend asked for, and the folder holds the weights once: torch writes
weights.safetensors only; onnxruntime writes the ORT-optimized graph only (the plain ONNX it was
optimized from is deleted; kept instead for `device: cuda`, for bf16 and with `build.optimize:
false`); tensorrt writes the plain ONNX and the plans, and is refused up front where TensorRT or a
GPU is missing. A folder runs the backend it was built for; `trtspec inspect --compare` rebuilds
the torch reference from the config's source when the folder has no torch weights.

Atomic and safe to run concurrently: a build holds a lock (`.DIR.lock` beside DIR) for as long as
it writes, so two builds of one folder run one after the other, and `trtspec run --config` that
finds the folder built meanwhile uses it instead of building it again. It writes into
DIR.partial-PID and renames that to DIR only once the manifest is written, so no half folder is ever
at DIR. SIGINT or SIGTERM removes the partial folder on the way out; after a SIGKILL, the next build
of DIR removes it (and any `*.partial-PID` beside it whose process is gone).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import click
from filelock import FileLock, Timeout
from safetensors.torch import save_file
from tqdm import tqdm

from ..engines.manifest import EngineError, verify, write_manifest
from ..engines.quantize import activations, exact_attention, fused_ops
from ..engines.stream import release_memory
from ..errors import Terminated
from ..export.contract import io_spec
from ..export.spec import DTYPES
from ..options import MAX_STEP_TOKENS
from .backends import BACKENDS
from .config import Config, ModelEntry
from .sources import load_tokenizer_for, open_source

PREFILL_CHUNK = MAX_STEP_TOKENS     # prefill chunk size (the runtime's; recorded in the manifest)


def build_engines(cfg: Config, output: str | Path, backend: str | None = None, force: bool = False,
                  log=click.echo, reuse: bool = False, checked: bool = False) -> Path:
    """Build `cfg` into `output`. `reuse`: an intact folder already there (built by another process
    while this one waited for the lock) is returned as it is. Refused in one line, before any work,
    where the build would not fit this machine's memory or disk (build_need.py; `checked`: the
    caller has just asked)."""
    output = Path(output)
    backend = backend or cfg.backend
    cfg = cfg.with_backend(backend)          # the backend's own config rules, before anything is built
    if output.exists() and not force and not reuse:
        raise EngineError(f"{output} already exists; pass --force to replace it or choose another --output")
    if reason := BACKENDS[backend].unavailable():
        raise EngineError(f"cannot build for backend {backend} here: {reason}; build with --backend onnxruntime "
                          "(or torch), or on a machine with its libraries and device")
    if not checked and not (reuse and intact(output)):
        from .build_need import check_build
        check_build(cfg, output, BACKENDS[backend].onnx)     # memory and disk, before any work
    output.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(output, log), interrupts() as signals:
        if reuse and intact(output):
            log(f"another build finished {output} meanwhile; using it")
            return output
        if output.exists() and not force:
            raise EngineError(f"{output} already exists; pass --force to replace it or choose another --output")
        clear_stale(output, log)
        tmp = output.with_name(f"{output.name}.partial-{os.getpid()}")
        tmp.mkdir()
        try:
            manifest = _build(cfg, tmp, backend, log)
            signals.check()                      # one a library swallowed ends the build here
            write_manifest(tmp, manifest)
            old = output.with_name(f"{output.name}.old-{os.getpid()}")
            if output.exists():
                os.replace(output, old)          # never a half-deleted folder at `output`
            os.replace(tmp, output)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(output.with_name(f"{output.name}.old-{os.getpid()}"), ignore_errors=True)
        from .load import measure_costs
        release_memory(collect=True)
        try:
            measure_costs(output, log=log)      # budget: auto plans with them (costs.json, not hashed)
        except Exception as e:                  # noqa: BLE001 - the build itself succeeded
            log(f"step costs not measured ({e}); budget: auto measures them at first use "
                f"(or: trtspec inspect --engines {output} --measure-costs)")
    return output


def intact(folder: Path) -> bool:
    try:
        return (folder / "manifest.json").exists() and bool(verify(folder))
    except EngineError:
        return False


@contextmanager
def build_lock(output: Path, log):
    """Hold `.NAME.lock` beside `output` while building it; say so while another build holds it."""
    lock = FileLock(str(output.with_name(f".{output.name}.lock")))
    try:
        lock.acquire(timeout=0.5)
    except Timeout:
        log(f"waiting for another build of {output} to finish")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


_STALE = re.compile(r"\.(partial|old)-(\d+)$")


def clear_stale(output: Path, log) -> None:
    """Remove what interrupted builds left beside `output` (called under its lock): its own
    `.partial-PID` / `.old-PID` folders whatever their PID (no build of it is running), and other
    folders' whose process is gone."""
    for p in output.parent.iterdir():
        m = _STALE.search(p.name)
        if not (m and p.is_dir()):
            continue
        if p.name[:m.start()] == output.name or not _alive(int(m.group(2))):
            log(f"removing {p}, left by an interrupted build")
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class interrupts:
    """While building, SIGTERM raises `Terminated` (its default kills the process without unwinding,
    which would leave the partial folder) and SIGINT raises KeyboardInterrupt, so the cleanup above
    runs. Both are remembered: an exception a signal caused inside a library (an import it cut
    short turns into ImportError) still ends the build as that signal, not as a traceback, and one
    raised where Python drops it (a weakref callback, a __del__: "Exception ignored in") ends it at
    `check()` or on the way out."""

    def __enter__(self):
        self.received, self.previous, self.unraisable = None, {}, None
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handler)
            self.unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def _unraisable(self, info) -> None:
        if self.received is None or not isinstance(info.exc_value, (KeyboardInterrupt, Terminated)):
            self.unraisable(info)                    # ours is remembered and raised at check(), not printed

    def _handler(self, signum, frame):
        self.received = signum
        raise self._error()

    def check(self) -> None:
        if self.received is not None:
            raise self._error()

    def _error(self) -> BaseException:
        return KeyboardInterrupt() if self.received == signal.SIGINT else Terminated(f"signal {self.received}")

    def __exit__(self, typ, exc, tb) -> bool:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.unraisable is not None:
            sys.unraisablehook = self.unraisable
        if self.received is not None and not isinstance(exc, (KeyboardInterrupt, Terminated)):
            raise self._error() from None
        return False


def _build(cfg: Config, out: Path, backend: str, log) -> dict:
    from ..export.tokenizer import check_same_vocab, save_tokenizer

    want_onnx = BACKENDS[backend].onnx        # build_engines refused a backend this machine cannot run
    roles = [("target", cfg.target)] + ([("draft", cfg.draft)] if cfg.draft else [])

    tok = load_tokenizer_for(cfg.target)
    if cfg.draft:
        check_same_vocab(tok, load_tokenizer_for(cfg.draft), cfg.target.model, cfg.draft.model)
    save_tokenizer(tok, out / "tokenizer")

    models = {}
    stop_ids: set[int] = set()
    heads = {}
    if cfg.heads:                   # first: a head that does not fit the target is refused before minutes of work
        target = open_source(cfg.target, "target").spec
        heads = {name: _build_head(out, name, head, target, log) for name, head in cfg.heads.items()}
    with _ahead(cfg, roles, want_onnx, log) as ahead:
        for role, entry in roles:
            models[role], stop_ids = _build_role(cfg, out, backend, role, entry, tok, want_onnx, ahead, stop_ids)
    models.update(heads)
    return {
        "config": cfg.with_backend(backend).to_dict(),
        "backend": backend,
        "models": models,
        "tokenizer": "tokenizer",
        "stop_ids": sorted(stop_ids),
        "prefill_chunk": PREFILL_CHUNK,
    }


@contextmanager
def _ahead(cfg: Config, roles, want_onnx: bool, log):
    """The draft's weightless graph exported in a worker process while this one builds the target
    (the exporter is single-threaded Python: minutes for a real model); {(role, dtype): a handle
    whose get() is the graph, or None to export in place}. Tiny models are exported in place (a
    process would cost more than it saves)."""
    later = [(role, entry) for role, entry in roles[1:] if not entry.model.startswith("tiny:")]
    if not (want_onnx and later):
        yield {}
        return
    from ..engines.export_worker import ExportJob
    jobs = {}
    try:
        for role, entry in later:
            for dt in cfg.build.onnx_dtypes:
                spec = open_source(entry, role).spec
                jobs[(role, dt)] = ExportJob(spec.to_dict(), dt, exact_attention(role, entry), cfg.build.opset,
                                             fused_ops(spec, entry.quantize))
        yield {key: _Answer(job, key, log) for key, job in jobs.items()}
    finally:
        for job in jobs.values():
            job.close()


class _Answer:
    def __init__(self, job, key, log):
        self.job, self.key, self.log = job, key, log

    def get(self):
        got = self.job.get()
        if got is None:
            self.log(f"{self.key[0]}: the export worker failed ({self.job.error()}); exporting here instead")
        return got


def _build_role(cfg: Config, out: Path, backend: str, role: str, entry: ModelEntry, tok, want_onnx: bool,
                ahead: dict, stop_ids: set[int]) -> tuple[dict, set[int]]:
    """One model's artifacts in `out`/ROLE: its manifest entry, and the stop ids (the target's)."""
    from ..export.model import choose_rope_factors
    from ..export.spec import SpecError
    from ..export.tokenizer import eos_token_ids
    q = f" {entry.quantize}" if entry.quantize != "none" else ""
    stages = ["open"] + ([] if want_onnx else ["weights"]) + [
        s for d in (cfg.build.onnx_dtypes if want_onnx else []) for s in (f"onnx {d}{q}", f"{backend} {d}")]
    bar = tqdm(stages, desc=f"{role}: {entry.model}", unit="stage", leave=True)
    folder = out / role
    folder.mkdir()
    info: dict = {"source": entry.model, "dtype": entry.dtype, "artifacts": {}}
    for stage in bar:
        bar.set_postfix_str(stage)
        if stage == "open":         # the spec and a reader of the weights: nothing loaded yet
            weights = open_source(entry, role)
            spec = weights.spec
            vocab = len(tok)
            if vocab > spec.vocab_size:
                raise SpecError(f"the tokenizer has {vocab} tokens but {role} {entry.model} only "
                                 f"{spec.vocab_size} embeddings: they do not belong together")
            if cfg.max_seq_len > spec.max_position_embeddings:
                raise EngineError(f"max_seq_len {cfg.max_seq_len} is longer than {role} {entry.model} was "
                                  f"trained for ({spec.max_position_embeddings} positions); lower "
                                  "max_seq_len in the config")
            choose_rope_factors(spec, cfg.max_seq_len)   # longrope: short or long factors, fixed per engine
            info["spec"] = spec.to_dict()
            exact = exact_attention(role, entry) if want_onnx else ""
            info["io"] = io_spec(spec, "fp64" if exact == "fp64" else entry.dtype, hidden=entry.hidden_rows)
            if exact:
                info["attention"] = exact
            if role == "target":        # the loaders' eos ids (GGUF / HF config) + the tokenizer's
                stop_ids = eos_token_ids(tok, spec)
        elif stage == "weights":        # the torch backend loads the whole model anyway
            save_file({k: weights.get(k, entry.torch_dtype) for k in weights.shapes},
                      str(folder / "weights.safetensors"))
            info["artifacts"]["weights"] = f"{role}/weights.safetensors"
        elif stage.startswith("onnx "):  # the graph, one tensor at a time
            dt = stage.split()[1]
            graph = _export_onnx(cfg, weights, folder, role, dt, entry, info, ahead.get((role, dt)), tok)
        else:                            # what the backend makes of it (ORT's optimized graph, plans)
            release_memory(collect=True)
            info["artifacts"].update(BACKENDS[backend].convert(cfg, spec, graph, role, stage.split()[1]))
    del weights
    release_memory(collect=True)
    return info, stop_ids


def _build_head(out: Path, name: str, entry, target, log) -> dict:
    """A head role's file in `out`/NAME, checked against the target it reads (export/head.py): its
    manifest entry. Every backend runs it in torch (a few small products per step)."""
    from ..export.head import read_head
    spec, state = read_head(entry.model, target.hidden_size, target.vocab_size, entry.kind)
    (out / name).mkdir()
    save_file(state, str(out / name / "head.safetensors"))
    log(f"{name}: a {spec.kind} head of depth {spec.depth} over {spec.rows} tokens, from {entry.model}")
    return {"kind": "head", "source": entry.model, "reads": "target", "spec": spec.to_dict(), "dtype": "fp32",
            "artifacts": {"weights": f"{name}/head.safetensors"}}


def _export_onnx(cfg: Config, weights, folder: Path, role: str, dt: str, entry: ModelEntry, info: dict,
                 ahead=None, tok=None) -> Path:
    """The model as an ONNX graph in dtype `dt` (weight-only quantized if asked), written one tensor
    at a time (engines/stream.py); `ahead`: its graph, being exported by a worker process."""
    from ..engines.quantize import ACCURACY_LEVEL, record
    from ..engines.stream import build_graph

    mode, acts = entry.quantize, activations(role, entry)
    path = folder / (f"model.{dt}.onnx" if mode == "none" else f"model.{dt}-{mode}.onnx")
    head = None
    if entry.head and entry.head < weights.spec.vocab_size:
        from ..engines.head_vocab import head_tokens
        head = head_tokens(tok, entry.head, weights.spec.vocab_size)
        info["head"] = {"tokens": len(head), "of": weights.spec.vocab_size,
                        "chosen_by": "token counts over Python's standard library (engines/head_vocab.py)"}
    counts = build_graph(weights, path, DTYPES[dt], exact_attention(role, entry), cfg.build.opset, mode,
                         ACCURACY_LEVEL[acts], desc=f"{role}: writing {path.name}",
                         exported=None if ahead is None else ahead.get(), head=head, hidden=entry.hidden_rows)
    if mode != "none":              # the config allows it for onnxruntime fp32 only
        if counts["matmuls_quantized"] == 0 and not counts.get("experts_quantized"):
            raise EngineError(f"{role} {entry.model}: no MatMul weight is a quantized tensor of the source; "
                              "use quantize int4")
        info["quantize"] = record(mode, acts, counts)
    return path
