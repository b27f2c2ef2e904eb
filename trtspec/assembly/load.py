"""Engine folder -> Generator (verified manifest, engines for the chosen backend, tokenizer)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..engines.manifest import EngineError, is_head, verify
from ..export.head import load_head
from ..export.model import Decoder
from ..export.spec import DTYPES, ModelSpec
from ..runtime.costs import COSTS_FILE, StoredCosts
from ..runtime.engine import Engine
from ..runtime.generator import Generator
from .backends import BACKENDS, LoadOptions
from .config import Config
from .memory import available_bytes, fit


def torch_model(folder: Path, role: str, info: dict, config: dict) -> Decoder:
    """The torch Decoder of an engine folder's `role`: its weights.safetensors, or, for a folder built
    for ONNX Runtime / TensorRT (which holds the weights once, in its own format), rebuilt from the
    manifest config's source (tools that need a torch reference: inspect --compare, HF peers)."""
    if "weights" in info["artifacts"]:
        state = load_file(str(folder / info["artifacts"]["weights"]))
        return Decoder.from_state(ModelSpec.from_dict(info["spec"]), state, DTYPES[info["dtype"]])
    from .sources import load_model
    cfg = Config.from_dict(config)
    return load_model(cfg.target if role == "target" else cfg.draft, role)


def load_engine(folder: Path, role: str, info: dict, backend: str, opts: LoadOptions = LoadOptions()) -> Engine:
    """The engine of one model of a folder, as `backend` runs it (backends.py)."""
    if backend not in BACKENDS:
        raise EngineError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[backend].load(folder, role, info, opts)


def open_folder(folder: str | Path, backend: str | None = None, config: Config | None = None
                ) -> tuple[dict, Config, str]:
    """Verify an engine folder and settle what will run, before anything heavy is loaded.

    Returns (manifest, config, backend). The backend is `backend`, else the one the folder was built
    for (manifest `backend`); a backend the folder has no artifacts for is refused with the rebuild
    command. `config`: runtime choices (strategy options, threads, buckets, device, draft
    quantization) to use instead of the recorded ones; it must describe the same build (digest)."""
    folder = Path(folder)
    manifest = verify(folder)
    cfg = Config.from_dict(manifest["config"], source=f"{folder}/manifest.json config")
    if config is not None:
        if config.with_backend(cfg.backend).digest() != cfg.digest():
            raise EngineError(f"{folder} was built from a different config than {config.source or config.name}; "
                              f"rebuild: trtspec build --config {config.source or 'CONFIG'} --output {folder}")
        cfg = config
    backend = backend or manifest.get("backend") or cfg.backend
    if backend not in BACKENDS:
        raise EngineError(f"{folder}: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    cfg = cfg.with_backend(backend)              # the backend's own config rules, checked again
    check_runnable(cfg)
    for role, info in manifest["models"].items():
        if not is_head(info) and not set(BACKENDS[backend].artifacts) & set(info["artifacts"]):
            built = manifest.get("backend", cfg.backend)
            raise EngineError(f"{folder} was built for {built} and has no {backend} artifacts for the {role}; "
                              f"run it with --backend {built}, or rebuild: trtspec build --config "
                              f"{config.source if config is not None and config.source else 'CONFIG'} "
                              f"--output {folder} --backend {backend} --force")
    return manifest, cfg, backend


def check_runnable(cfg: Config) -> None:
    """EngineError if this machine cannot run `cfg` (its backend or device), before any engine loads."""
    reason = BACKENDS[cfg.backend].unavailable()
    if reason:
        raise EngineError(f"cannot run backend {cfg.backend} here: {reason}; use --backend onnxruntime or torch")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise EngineError("the config says device: cuda but no CUDA GPU is visible to torch; set device: cpu "
                          "or run on a machine with a GPU (and torch built with CUDA)")


def load_role(folder: Path, role: str, manifest: dict, cfg: Config, backend: str, threads: int,
              profile_prefix: str | None = None) -> Engine:
    """The engine of `role` as the config runs it (device, CUDA graphs, a torch draft's int8, a GPU
    target exact by one step shape)."""
    quantize = cfg.draft.quantize if role == "draft" else "none"
    exact = cfg.exactness if role == "target" and cfg.exact else ""     # (cfg is the run backend's: open_folder)
    return load_engine(folder, role, manifest["models"][role], backend,
                       LoadOptions(threads, quantize, cfg.device, cfg.cuda_graphs, profile_prefix, exact))


def measure_costs(folder: str | Path, threads: int | None = None, backend: str | None = None, log=print):
    """Measure the folder's step costs on this machine and store them in costs.json (runtime/costs.py)."""
    from ..runtime.costs import measure
    folder = Path(folder)
    manifest, cfg, backend = open_folder(folder, backend)
    threads = cfg.threads if threads is None else threads
    if threads:
        torch.set_num_threads(threads)
    target = load_role(folder, "target", manifest, cfg, backend, threads)
    draft = load_role(folder, "draft", manifest, cfg, backend, threads) if "draft" in manifest["models"] else None
    heads = load_heads(folder, manifest, cfg.device)
    log(f"measuring step costs on this machine ({backend}, {threads or 'default'} threads) for budget: auto")
    try:
        costs = measure(target, draft, cfg.max_seq_len, threads, backend, buckets=cfg.step_buckets(),
                        progress=True, key=costs_key(cfg, backend, threads), heads=heads)
    finally:
        for engine in (target, draft):
            if engine is not None:
                engine.close()
    costs.save(folder / COSTS_FILE)
    return costs


def load_heads(folder: Path, manifest: dict, device: str) -> dict:
    """The folder's head roles, by name (export/head.py): run by torch on `device` whatever the backend."""
    return {role: load_head(info["spec"], Path(folder) / info["artifacts"]["weights"], device)
            for role, info in manifest["models"].items() if is_head(info)}


def load_tokenizer(folder: str | Path, manifest: dict):
    from ..export.tokenizer import load_tokenizer as load
    return load(Path(folder) / manifest["tokenizer"], cache=False)


def check_fits(folder: Path, manifest: dict, cfg: Config, slots: int | None = None, prefix_cache: int | None = None,
               copies: int = 1) -> None:
    """EngineError (one line, with what would fit) unless `copies` generators of this folder fit in this
    machine's memory (`trtspec serve --replicas` on a local Ray instance loads one per replica)."""
    if cfg.device != "cpu":
        return
    slots = slots or cfg.slots
    stored = next((p for p in (prefix_cache, cfg.prefix_cache) if p is not None), cfg.max_seq_len)
    avail = available_bytes()
    fit(Path(folder), manifest, cfg.max_seq_len, slots, stored=stored,
        available=None if copies == 1 or avail is None else avail // copies)


def load_generator(folder: str | Path, backend: str | None = None, threads: int | None = None,
                   config: Config | None = None, opened: tuple[dict, Config, str] | None = None,
                   tokenizer=None, slots: int | None = None, max_queue: int | None = None,
                   prefix_cache: int | None = None, strategy_options: dict | None = None,
                   costs=None, hooks=None) -> Generator:
    """Engines + KV buffers + tokenizer of an engine folder (see `open_folder` for the arguments;
    pass its result as `opened`, and a tokenizer already loaded, to skip doing them twice).
    `strategy_options`: the strategies' options, if not the config's; `costs`: the step costs
    budget: auto plans with (a runtime/costs.py CostModel), if not the folder's stored ones; `hooks`:
    an observer of the runtime (runtime/hooks.py), e.g. a lab instrument."""
    folder = Path(folder)
    manifest, cfg, backend = opened or open_folder(folder, backend, config)
    threads = cfg.threads if threads is None else threads
    slots = slots or cfg.slots
    prefix_cache = next((p for p in (prefix_cache, cfg.prefix_cache) if p is not None), cfg.max_seq_len)
    check_fits(folder, manifest, cfg, slots, prefix_cache)               # refused in one line before loading
    if threads:
        torch.set_num_threads(threads)
    target = load_role(folder, "target", manifest, cfg, backend, threads)
    draft = load_role(folder, "draft", manifest, cfg, backend, threads) if "draft" in manifest["models"] else None
    heads = load_heads(folder, manifest, cfg.device)
    tok = tokenizer if tokenizer is not None else load_tokenizer(folder, manifest)
    gen = Generator(target, draft, tokenizer=tok, capacity=cfg.max_seq_len,
                    stop_ids=set(manifest.get("stop_ids", [])),
                    strategy_options=cfg.strategies if strategy_options is None else strategy_options,
                    buckets=cfg.step_buckets(), slots=slots, max_queue=max_queue, owns_engines=True,
                    prefix_cache=prefix_cache, heads=heads, config=cfg, backend=backend, costs=costs, hooks=hooks,
                    stored_costs=StoredCosts(folder, costs_key(cfg, backend, threads)))
    if uses_auto(cfg):
        gen.step_costs()         # stored, or measured now: not inside the first request's submit
    return gen


def costs_key(cfg: Config, backend: str, threads: int) -> dict:
    """What a step-cost table must have been measured for to serve this run (runtime/costs.py)."""
    from ..runtime.costs import run_key
    heads = {"heads": sorted(h.kind for h in cfg.heads.values())} if cfg.heads else {}    # (keys stored before heads)
    return run_key(threads or 0, backend, cfg.draft is not None, device=cfg.device, cuda_graphs=cfg.cuda_graphs,
                   draft_quantize=cfg.draft.quantize if cfg.draft else None, buckets=cfg.step_buckets(), **heads)


def uses_auto(cfg: Config) -> bool:
    """Whether any strategy of the config (its default or one configured) sizes its trees per step."""
    from ..runtime.strategies import strategy
    names = {cfg.strategy, *cfg.strategies}
    runs = {**cfg.runs_with(), "has_draft": True}      # a configured strategy may need a draft the default does not
    return any(strategy(n, cfg.strategies, **runs).auto_nodes() is not None for n in names)
