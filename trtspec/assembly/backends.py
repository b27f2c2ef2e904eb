"""The backends, in one registry: what each builds into an engine folder, which of its artifacts it
loads, which config options it takes, and whether this machine can run it.

Adding a backend is one `Backend` entry here plus its engine file in `trtspec/engines/` (a class
implementing `runtime.engine.Engine`): `trtspec build`, loading, config checks and every `--backend`
choice read this registry. Engine modules are imported when a backend is used, never before (the
TensorRT and CUDA ones need libraries this machine may lack).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from .config import Config, ModelEntry


@dataclass(frozen=True)
class LoadOptions:
    threads: int = 0                  # CPU threads (0: the library's default)
    quantize: str = "none"            # a torch draft's load-time int8
    device: str = "cpu"
    cuda_graphs: bool = False
    profile_prefix: str | None = None  # ONNX Runtime's profiler (stepcost --profile)
    exact: str = ""                   # a torch target exact by one step shape: config.exactness ("": not)


@dataclass(frozen=True)
class Backend:
    name: str
    builds: str                                           # what `trtspec build` writes per model
    artifacts: tuple[str, ...]                            # manifest keys it runs, preferred first
    onnx: bool                                            # built from the exported ONNX graph
    quantizes_at_load: bool                               # `quantize:` is applied when loading, not built
    load: Callable[[Path, str, dict, LoadOptions], "Engine"]
    quantize_rule: Callable[[str, "ModelEntry", "Config"], str | None]   # why a quantized model is refused
    rules: Callable[["Config"], str | None] = lambda cfg: None           # other config options it refuses
    # (cfg, spec, exported ONNX path, role, dtype) -> that dtype's artifacts {key: path in the folder}
    convert: Callable[..., dict[str, str]] = lambda cfg, spec, path, role, dt: {f"onnx_{dt}": f"{role}/{path.name}"}
    unavailable: Callable[[], str | None] = lambda: None                 # why this machine cannot run it


# -- torch ---------------------------------------------------------------------------------------
def _load_torch(folder: Path, role: str, info: dict, opts: LoadOptions) -> "Engine":
    from safetensors.torch import load_file

    from ..engines.quantize import quantize_decoder
    from ..engines.torch_engine import TorchEngine
    from ..export.model import Decoder
    from ..export.spec import DTYPES, ModelSpec
    model = Decoder.from_state(ModelSpec.from_dict(info["spec"]), load_file(str(folder / info["artifacts"]["weights"])),
                               DTYPES[info["dtype"]])
    model.hidden_rows = returns_hidden(info)
    model = quantize_decoder(model, opts.quantize)
    make = TorchEngine
    if opts.cuda_graphs:
        from ..engines.cuda_graphs import GraphedTorchEngine as make

    def build(m):
        return make(m, opts.device)

    if opts.exact == "logical":
        from ..engines.logical_engine import LogicalTorchEngine
        return LogicalTorchEngine(model, opts.device, cuda_graphs=opts.cuda_graphs)
    if opts.exact:
        from ..engines.exact import exact_engine
        return exact_engine(build, model)
    return build(model)


def returns_hidden(info: dict) -> bool:
    """Whether a folder's model was built to return its hidden rows (its manifest I/O; contract v4)."""
    return any(o["name"] == "hidden" for o in info.get("io", {}).get("outputs", []))


def _torch_quantize(role: str, entry: "ModelEntry", cfg: "Config") -> str | None:
    q = f"{role}.quantize: {entry.quantize}"
    if role == "target":
        return f"{q}: the torch backend does not quantize targets; use backend onnxruntime with target.quantize int4"
    if entry.quantize != "int8":
        return (f"{q}: the torch backend has no int4 kernels: set draft.quantize int8 (torch's dynamic int8) or "
                "none, or use backend onnxruntime")
    return None


# -- onnxruntime ---------------------------------------------------------------------------------
ORT_ARTIFACTS = ("ort_fp32", "onnx_fp32", "ort_fp16", "onnx_fp16")


def _load_ort(folder: Path, role: str, info: dict, opts: LoadOptions) -> "Engine":
    from ..engines.manifest import EngineError
    from ..export.spec import DTYPES, ModelSpec
    spec, arts = ModelSpec.from_dict(info["spec"]), info["artifacts"]
    if opts.device == "cuda" and opts.cuda_graphs:     # not exercised in CI (no GPU): see the module
        from ..engines.onnxruntime_cuda import OrtCudaGraphEngine
        for key in ("onnx_fp16", "onnx_bf16", "onnx_fp32"):
            if key in arts:
                return OrtCudaGraphEngine(folder / arts[key], spec, DTYPES[key.split("_")[1]])
    from ..engines.onnxruntime_engine import OrtEngine
    for key in ORT_ARTIFACTS:                          # preferred first
        if key in arts:
            return OrtEngine(folder / arts[key], spec, intra_op_threads=opts.threads or None,
                             profile_prefix=opts.profile_prefix)
    raise EngineError(f"{folder}: no ONNX model for {role} that ONNX Runtime on CPU can run (fp32/fp16); "
                      "rebuild with --backend onnxruntime and build.onnx_dtypes: [fp32]")


def _ort_quantize(role: str, entry: "ModelEntry", cfg: "Config") -> str | None:
    q = f"{role}.quantize: {entry.quantize}"
    if role == "target" and entry.quantize == "int8" and entry.activations != "int8":
        return (f"{q}: ONNX Runtime has no fast int8-weight kernel with fp32 activations (3.6 s per Qwen 1.5B step): "
                "set target.activations int8 (exact attention keeps it lossless), or quantize the target to int4")
    if entry.quantize == "gguf" and not (entry.model.startswith("pack:") or entry.model.endswith(".gguf")):
        return (f"{q}: takes the blocks of a GGUF source, and {entry.model} is not one: point {role}.model at "
                "a .gguf file, or use quantize int4")
    if entry.dtype != "fp32" or cfg.build.onnx_dtypes != ["fp32"]:
        return (f"{q}: ONNX Runtime quantizes the fp32 graph (its MatMulNBits kernels take fp32 activations on "
                f"CPU): set {role}.dtype fp32 and build.onnx_dtypes [fp32]")
    return None


def _ort_rules(cfg: "Config") -> str | None:
    if not {"fp32", "fp16"} & set(cfg.build.onnx_dtypes):
        return "backend onnxruntime needs fp32 or fp16 in build.onnx_dtypes (its CPU kernels have no bf16)"
    if cfg.buckets.cache:
        return ("backend onnxruntime takes token buckets only (a padded past would overlap the rows it writes): "
                "remove buckets.cache, or use backend torch")
    return None


def _ort_convert(cfg: "Config", spec, path: Path, role: str, dt: str) -> dict[str, str]:
    """ONNX Runtime's offline-optimized graph replaces the plain export (one copy of the weights per
    folder); its CPU optimizer has no bf16 kernels, and its fused graph is for the CPU provider."""
    if not cfg.build.optimize or dt == "bf16" or cfg.device != "cpu":
        return {f"onnx_{dt}": f"{role}/{path.name}"}
    from ..export.onnx_export import optimize_for_ort, remove_graph
    opt = path.with_name(path.name.replace(".onnx", ".ort.onnx"))
    optimize_for_ort(path, opt)
    remove_graph(path)
    return {f"ort_{dt}": f"{role}/{opt.name}"}


# -- tensorrt ------------------------------------------------------------------------------------
def _load_trt(folder: Path, role: str, info: dict, opts: LoadOptions) -> "Engine":
    from ..engines.tensorrt_engine import TrtEngine  # not exercised in CI (see the module docstring)
    from ..export.spec import ModelSpec
    plans = [k for k in info["artifacts"] if k.startswith("plan_")]      # open_folder checked there is one
    return TrtEngine(folder / info["artifacts"][plans[0]], ModelSpec.from_dict(info["spec"]),
                     cuda_graphs=opts.cuda_graphs)


def _trt_quantize(role: str, entry: "ModelEntry", cfg: "Config") -> str | None:
    return (f"{role}.quantize: {entry.quantize}: quantized engines are built for backend onnxruntime (TensorRT "
            "plans of them never ran here); use backend onnxruntime, or remove quantize")


def _trt_convert(cfg: "Config", spec, path: Path, role: str, dt: str) -> dict[str, str]:
    from ..engines.tensorrt_build import build_plan
    from ..options import MAX_STEP_TOKENS
    from ..runtime.batch import MAX_BATCH_TOKENS
    plan = path.with_name(f"model.{dt}.plan")
    # Batched steps pad the past to the longest row and T to the batch's: allow that headroom.
    build_plan(path, plan, spec, cfg.max_seq_len + MAX_BATCH_TOKENS, MAX_STEP_TOKENS, max_step_tokens=128,
               max_batch=max(8, cfg.slots))
    return {f"onnx_{dt}": f"{role}/{path.name}", f"plan_{dt}": f"{role}/{plan.name}"}


def _trt_unavailable() -> str | None:
    from ..engines.tensorrt_build import tensorrt_unavailable_reason
    return tensorrt_unavailable_reason()


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("torch", "weights.safetensors", ("weights",), onnx=False, quantizes_at_load=True, load=_load_torch,
            quantize_rule=_torch_quantize),
    Backend("onnxruntime", "model.{dtype}.ort.onnx (the ORT-optimized export)", ORT_ARTIFACTS, onnx=True,
            quantizes_at_load=False, load=_load_ort, quantize_rule=_ort_quantize, rules=_ort_rules,
            convert=_ort_convert),
    Backend("tensorrt", "model.{dtype}.onnx + model.{dtype}.plan", ("plan_fp32", "plan_fp16", "plan_bf16"),
            onnx=True, quantizes_at_load=False, load=_load_trt, quantize_rule=_trt_quantize, convert=_trt_convert,
            unavailable=_trt_unavailable),
)}
NAMES = tuple(BACKENDS)


def check(cfg: "Config") -> str | None:
    """Why `cfg`'s backend refuses its options (None: it takes them)."""
    backend = BACKENDS[cfg.backend]
    for role, entry in (("target", cfg.target), ("draft", cfg.draft)):
        if entry is not None and entry.activations != "auto" and (entry.quantize == "none" or cfg.backend != "onnxruntime"):
            return (f"{role}.activations: {entry.activations}: sets how ONNX Runtime's quantized MatMuls take their "
                    f"activations; use backend onnxruntime with {role}.quantize int4 or gguf, or remove activations")
        if entry is None or entry.quantize == "none":
            continue
        if cfg.device == "cuda":
            return (f"{role}.quantize: {entry.quantize}: quantized engines run on CPU (ONNX Runtime's CUDA path "
                    "for them never ran here); set device: cpu, or remove quantize")
        why = backend.quantize_rule(role, entry, cfg)
        if why:
            return why
    return backend.rules(cfg)
