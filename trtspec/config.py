"""Config: one YAML file says which models, which precision, which backend, which strategy.

    name: qwen2.5-coder-1.5b
    target: {model: pack:qwen2.5-coder-1.5b, dtype: bf16}
    draft:  {model: pack:qwen2.5-coder-0.5b, dtype: bf16}      # optional
    backend: torch            # runtime default: torch | onnxruntime | tensorrt
    max_seq_len: 2048
    threads: 2                # 0 = leave torch / ONNX Runtime defaults
    strategy: chain           # default for `trtspec run`
    strategies: {chain: {k: 4}, ngram: {k: 8}}
    build: {onnx_dtypes: [fp32], opset: 18}

`model` is a Hugging Face folder, a .gguf file, a `pack:NAME` demo pack, or `tiny:SEED` (a seeded
random model, for smoke tests). Unknown keys are errors, so a typo never silently does nothing.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import yaml

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BACKENDS = ("torch", "onnxruntime", "tensorrt")
PACKAGE_CONFIGS = Path(__file__).resolve().parent.parent / "configs"   # the repo's configs/
DEFAULT_CONFIG = "qwen2.5-coder-1.5b"


class ConfigError(ValueError):
    pass


@dataclass
class ModelEntry:
    model: str
    dtype: str = "fp32"
    tiny: dict[str, Any] = field(default_factory=dict)   # tiny:SEED only: tiny_spec() overrides
    layers: int = 0   # >0: keep only the first N layers (+ final norm and head): a self-draft
    quantize: str = "none"   # draft only: "int8" = weight-only dynamic int8 (torch backend)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.layers < 0:
            raise ConfigError(f"layers must be >= 0 (got {self.layers})")
        if self.quantize not in ("none", "int8"):
            raise ConfigError(f"quantize {self.quantize!r} is not one of none, int8")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class BuildOptions:
    onnx_dtypes: list[str] = field(default_factory=lambda: ["fp32"])
    opset: int = 18
    optimize: bool = True

    def __post_init__(self) -> None:
        bad = [d for d in self.onnx_dtypes if d not in DTYPES]
        if bad:
            raise ConfigError(f"build.onnx_dtypes has {bad}; allowed: {', '.join(DTYPES)}")
        if self.opset < 17:
            raise ConfigError(f"build.opset must be >= 17 (got {self.opset})")


@dataclass
class Config:
    name: str
    target: ModelEntry
    draft: ModelEntry | None = None
    backend: str = "torch"
    device: str = "cpu"            # torch backend: cpu | cuda
    cuda_graphs: bool = False      # torch backend: one graph per step shape (use with buckets)
    max_seq_len: int = 2048
    threads: int = 0
    strategy: str = "ar"
    strategies: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Static-shape buckets {tokens: [...], cache: [...]}: T and C are padded up to these sizes so
    # steps reuse a few shapes (CUDA graphs, TensorRT profiles). Off (exact shapes) when empty.
    buckets: dict[str, list[int]] = field(default_factory=dict)
    build: BuildOptions = field(default_factory=BuildOptions)
    source: str = ""   # where it was read from (not part of the hash)

    def __post_init__(self) -> None:
        if self.target.quantize != "none":
            raise ConfigError("quantize is for drafts only: a quantized target would change the output; "
                              "remove `quantize` from target (use dtype to choose its precision)")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device {self.device!r} is not one of cpu, cuda")
        if self.max_seq_len < 16:
            raise ConfigError(f"max_seq_len must be >= 16 (got {self.max_seq_len})")
        bad = set(self.buckets) - {"tokens", "cache"}
        if bad or not all(isinstance(v, list) and all(isinstance(x, int) and x > 0 for x in v)
                          for v in self.buckets.values()):
            raise ConfigError("buckets must look like {tokens: [1, 8, 32], cache: [512, 1024, 2048]} "
                              "(positive integers)")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "") -> "Config":
        known = {f.name for f in fields(cls)} - {"source"}
        unknown = set(d) - known
        if unknown:
            raise ConfigError(f"{source or 'config'}: unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
        if "name" not in d or "target" not in d:
            raise ConfigError(f"{source or 'config'}: needs at least `name` and `target: {{model: ...}}`")
        try:
            d = dict(d)
            d["target"] = _entry(d["target"])
            d["draft"] = _entry(d["draft"]) if d.get("draft") else None
            d["build"] = BuildOptions(**(d.get("build") or {}))
            return cls(**d, source=source)
        except TypeError as e:
            raise ConfigError(f"{source or 'config'}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    def digest(self) -> str:
        """Identifies what a build of this config produces (the engine cache key)."""
        keep = {k: v for k, v in self.to_dict().items() if k not in ("strategy", "strategies", "threads")}
        for k in ("device", "cuda_graphs", "buckets"):   # runtime choices, not build inputs
            keep.pop(k, None)
        for role in ("target", "draft"):       # quantization happens at load, not at build
            if keep.get(role):
                keep[role] = {k: v for k, v in keep[role].items() if k != "quantize"}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _entry(v: Any) -> ModelEntry:
    if isinstance(v, str):
        return ModelEntry(model=v)
    if not isinstance(v, dict) or "model" not in v:
        raise ConfigError("target/draft must be `{model: PATH_OR_PACK, dtype: fp32|fp16|bf16}`")
    return ModelEntry(**v)


def load_config(path: str | Path | None) -> Config:
    """Read a YAML config; None = the default; a bare name = a config shipped with trtspec."""
    if path is None:
        path = DEFAULT_CONFIG
    p = Path(path)
    if not p.exists() and (PACKAGE_CONFIGS / f"{path}.yaml").exists():
        p = PACKAGE_CONFIGS / f"{path}.yaml"
    if not p.exists():
        shipped = ", ".join(sorted(q.stem for q in PACKAGE_CONFIGS.glob("*.yaml")))
        raise ConfigError(f"config {path} not found; give a YAML path or one of the shipped configs: {shipped}")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return Config.from_dict(data, source=str(p))
