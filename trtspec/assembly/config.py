"""Config: one YAML file says which models, which precision, which backend, which strategy.

    name: qwen2.5-coder-1.5b
    target: {model: pack:qwen2.5-coder-1.5b, dtype: bf16}
    draft:  {model: pack:qwen2.5-coder-0.5b, dtype: bf16}      # optional
    backend: torch            # runtime default: torch | onnxruntime | tensorrt
    max_seq_len: 2048
    slots: 4                  # requests served at once (each owns a KV slot; their steps are batched)
    threads: 2                # 0 = leave torch / ONNX Runtime defaults
    strategy: chain           # default for `trtspec run`
    strategies: {chain: {k: 4}, ngram: {k: 8}}
    build: {onnx_dtypes: [fp32], opset: 18}

`model` is a Hugging Face folder, a .gguf file, a `pack:NAME` demo pack, or `tiny:SEED` (a seeded
random model, for smoke tests). The whole file is checked when it loads (types, ranges, unknown
keys, every strategy's options, whether the largest tree fits the KV capacity): a problem is one
ConfigError line naming the key, the value and what is allowed, before anything is built or run.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from ..errors import ConfigError
from ..export.spec import DTYPES
from ..options import MAX_STEP_TOKENS, PosInt, Strict, one_line

CONFIGS_DIR = Path(__file__).resolve().parents[1] / "configs"   # shipped configs (package data)
DEFAULT_CONFIG = "qwen2.5-coder-1.5b"
# The torch.export-based ONNX exporter emits opset 18 and newer; 23 is the newest torch 2.13 writes.
MIN_OPSET, MAX_OPSET = 18, 23

Dtype = Literal["fp32", "fp16", "bf16"]
__all__ = ["CONFIGS_DIR", "Config", "ConfigError", "HeadEntry", "ModelEntry", "BuildOptions", "load_config"]


class TinyOptions(Strict):
    """`tiny:SEED` model shape overrides (smoke tests): bounded so a typo cannot ask for a giant model."""
    arch: str = "llama"                              # a family in export/families/
    vocab_size: Annotated[int, Field(ge=16, le=65536)] = 512
    hidden_size: Annotated[int, Field(ge=8, le=1024)] = 64
    num_layers: Annotated[int, Field(ge=1, le=8)] = 2
    num_heads: Annotated[int, Field(ge=1, le=32)] = 4
    num_kv_heads: Annotated[int, Field(ge=1, le=32)] = 2
    tie: bool = False
    window: Annotated[int, Field(ge=1)] | None = None    # a sliding window (every layer; Gemma 3: its windowed ones)

    @model_validator(mode="after")
    def _shape(self) -> "TinyOptions":
        from ..export.families import FAMILIES
        if self.arch not in FAMILIES:
            raise ValueError(f"arch {self.arch!r} is not a model family trtspec builds ({', '.join(FAMILIES)})")
        if self.hidden_size % (2 * self.num_heads):
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of 2 x num_heads ({self.num_heads}) "
                             "(an even head size for RoPE)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        return self


class ModelEntry(Strict):
    model: Annotated[str, Field(min_length=1)]
    dtype: Dtype = "fp32"
    tiny: TinyOptions = Field(default_factory=TinyOptions)   # tiny:SEED only
    layers: Annotated[int, Field(ge=0, le=1000)] = 0   # >0: keep only the first N layers: a self-draft
    # Weight-only: onnxruntime builds MatMulNBits graphs (target int4 / gguf; draft int4 / int8 /
    # gguf: the GGUF source's own blocks, bit-exact); torch quantizes a draft to dynamic int8 at load.
    # A quantized target *is* the target (lossless = its ar).
    quantize: Literal["none", "int8", "int4", "gguf"] = "none"
    # What a quantized ONNX Runtime model's MatMuls do with their activations (MatMulNBits' accuracy
    # level). auto: the target fp32 (level 1), drafts int8 (level 4). A target at int8 (about 1.7x
    # faster per step here) gets exact attention (`attention` below), so a tree's rows give the
    # logits of one-token forwards (docs/design.md, "Exact attention").
    activations: Literal["auto", "fp32", "int8"] = "auto"
    # A target's exact attention (onnxruntime, quantized, int8 activations): auto = logical (each
    # row's keys in logical order, in fp32: exact by construction, 56 KiB of KV a token on the default
    # target); fp64 = attention and KV in fp64 (exact by rounding: twice the KV memory; one-token steps
    # within 3% of logical's at 256 cached, trees up to 1.35x slower past ~1k cached: docs/benchmarks.md,
    # "Attention by logical order, the default").
    attention: Literal["auto", "fp64", "logical"] = "auto"
    # Drafts on ONNX backends: an LM head over this many tokens, those the build counts most often in
    # Python's standard library (FR-Spec; engines/head_vocab.py). The draft never proposes another
    # token; outputs are unchanged (the target verifies every token). 0: the whole vocabulary.
    head: Annotated[int, Field(ge=0, le=1 << 24)] = 0
    # The target's step also returns the rows its LM head reads (step contract v4's hidden rows), for
    # a drafter that reads them (a head: EAGLE, Medusa, MTP). Off: a graph without them is unchanged.
    hidden_rows: bool = False

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        if v.startswith("tiny:") and not v[5:].isdigit():
            raise ValueError("tiny models are named tiny:SEED with an integer seed, e.g. tiny:0")
        return v

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class HeadEntry(Strict):
    """A head role (export/head.py): its own weights, reading the target's hidden rows."""
    # A head file (safetensors), relative to the config; the folder keeps its own copy (a file changed
    # under the same path is not a new config: rebuild with --force).
    model: Annotated[str, Field(min_length=1)]
    kind: Literal["medusa"] = "medusa"


RESERVED = ("target", "draft", "tokenizer")          # names a head role cannot take (other roles, folders)


class BuildOptions(Strict):
    onnx_dtypes: Annotated[list[Dtype], Field(min_length=1)] = Field(default_factory=lambda: ["fp32"])
    opset: Annotated[int, Field(ge=MIN_OPSET, le=MAX_OPSET)] = 18
    optimize: bool = True

    @field_validator("onnx_dtypes")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("each dtype at most once")
        return v


class Buckets(Strict):
    tokens: list[Annotated[int, Field(ge=1, le=MAX_STEP_TOKENS)]] = Field(default_factory=list)
    cache: list[PosInt] = Field(default_factory=list)


class Config(Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]   # names the cache folder
    target: ModelEntry
    draft: ModelEntry | None = None
    # Head roles by name (drafters that read the target's hidden rows: a `medusa` drafter asks the
    # `kind: medusa` one); each is built into the folder as NAME/head.safetensors.
    heads: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,31}$")], HeadEntry] = Field(default_factory=dict)
    backend: str = "torch"                          # a name in assembly/backends.py
    device: Literal["cpu", "cuda"] = "cpu"          # torch backend
    cuda_graphs: bool = False                       # one graph per step shape (use with buckets)
    # A torch target on a GPU: `fixed-fp64` runs every decode step at one padded shape with fp64
    # attention and no split-K (engines/exact.py: lossless there, measured); `logical` the same shape
    # with attention in the model's dtype, each row's keys in logical order, the KV pool read in place
    # (engines/logical_engine.py, Triton: exact by construction, checked on the CPU's interpreter, not
    # yet measured on a GPU); `plain` lets each step take its own shape (faster, not lossless: GPU
    # kernels differ by shape). No effect on a CPU.
    exactness: Literal["fixed-fp64", "logical", "plain"] = "fixed-fp64"
    max_seq_len: Annotated[int, Field(ge=16, le=1 << 20)] = 2048
    slots: Annotated[int, Field(ge=1, le=256)] = 4     # requests served at once (KV slots, batch rows)
    # prompt tokens kept per model across requests (prefix caching; default max_seq_len, 0 = off)
    prefix_cache: Annotated[int, Field(ge=0, le=1 << 22)] | None = None
    threads: Annotated[int, Field(ge=0, le=1024)] = 0
    strategy: str = "ar"
    strategies: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # Static-shape buckets {tokens: [...], cache: [...]}: T and C are padded up to these sizes so
    # steps reuse a few shapes (CUDA graphs, TensorRT profiles). Off (exact shapes) when empty.
    buckets: Buckets = Field(default_factory=Buckets)
    build: BuildOptions = Field(default_factory=BuildOptions)
    source: str = Field("", exclude=True)   # where it was read from (not part of the hash)

    @field_validator("target", "draft", mode="before")
    @classmethod
    def _short_entry(cls, v: Any) -> Any:
        return {"model": v} if isinstance(v, str) else v

    @field_validator("heads", mode="before")
    @classmethod
    def _short_heads(cls, v: Any) -> Any:
        return {k: {"model": h} if isinstance(h, str) else h for k, h in v.items()} if isinstance(v, dict) else v

    @field_validator("strategies", mode="before")
    @classmethod
    def _strategies_none(cls, v: Any) -> Any:
        return {} if v is None else v

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        from .backends import NAMES
        if v not in NAMES:
            raise ValueError(f"choose one of {', '.join(NAMES)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        from ..runtime.strategies import STRATEGIES, heads_missing, hidden_rows_missing, make_strategy
        from .backends import check
        why = check(self)                              # the backend's own rules (quantize, dtypes, buckets)
        if why:
            raise ValueError(why)
        if self.target.head:
            raise ValueError(f"target.head: {self.target.head}: only a draft's LM head may be reduced (the target's "
                             "logits decide every output token); move head to draft, or remove it")
        for role, entry in (("target", self.target), ("draft", self.draft)):
            if entry is not None and entry.attention != "auto" and not (
                    role == "target" and self.backend == "onnxruntime" and entry.quantize != "none"
                    and entry.activations == "int8"):
                raise ValueError(f"{role}.attention: {entry.attention} chooses the exact attention of an onnxruntime "
                                 "target with quantize and activations: int8; remove it, or set those")
        if self.draft is not None and self.draft.hidden_rows:
            raise ValueError("draft.hidden_rows: true: a head reads the target's rows, not the draft's; move "
                             "hidden_rows to target, or remove it")
        self._check_heads()
        ort_graphs = self.backend == "onnxruntime" and self.cuda_graphs and self.device == "cuda"
        if self.target.hidden_rows and (self.backend == "tensorrt" or ort_graphs):
            which = "TensorRT plans" if self.backend == "tensorrt" else "ONNX Runtime's CUDA graphs"
            raise ValueError(f"target.hidden_rows: true: {which} do not bind the hidden rows yet; use backend "
                             "torch (with or without cuda_graphs) or onnxruntime without them, or remove hidden_rows")
        if self.draft is not None and self.draft.head and self.backend == "torch":
            raise ValueError(f"draft.head: {self.draft.head}: a reduced head is built into ONNX graphs; use backend "
                             "onnxruntime (or tensorrt), or remove head")
        if self.exact and (len(self.buckets.tokens) > 1 or len(self.buckets.cache) > 1):
            raise ValueError(f"buckets {self.buckets.model_dump()}: on device: cuda every target step runs at one "
                             f"shape (exactness: {self.exactness}, lossless there); give buckets.tokens and buckets.cache "
                             "one size each (or none: 16 tokens, max_seq_len), or set exactness: plain (faster, "
                             "not lossless on a GPU)")
        if self.buckets.cache and max(self.buckets.cache) > self.max_seq_len:
            raise ValueError(f"buckets.cache {self.buckets.cache}: a cache bucket above max_seq_len "
                             f"{self.max_seq_len} is never used; keep buckets <= max_seq_len")
        for name in [self.strategy, *self.strategies]:
            if name not in STRATEGIES:
                raise ValueError(f"strategy {name!r} is not one of {', '.join(STRATEGIES)}")
        for name in dict.fromkeys([self.strategy, *self.strategies]):
            opts = self.strategies.get(name) or {}
            if not isinstance(opts, dict):
                raise ValueError(f"strategies.{name} must be a mapping of options, e.g. {{k: 4}}")
            if name == "cascade" and opts.get("bigram") and self.source:   # relative to the config file
                opts = {**opts, "bigram": str((Path(self.source).parent / str(opts["bigram"])).resolve())}
                self.strategies[name] = opts
            strat = make_strategy(name, **opts)        # raises ConfigError naming strategies.NAME.KEY
            if strat.reads_hidden and not self.target.hidden_rows:
                raise ValueError(hidden_rows_missing(name, strat) + ": set target.hidden_rows: true and rebuild")
            if why := heads_missing(name, strat, {h.kind for h in self.heads.values()}):
                raise ValueError(why)
            if strat.needs_draft and self.draft is None and name == self.strategy:
                raise ValueError(f"strategy {name!r} needs a draft model: add `draft:` or choose ar / ngram")
            if strat.max_tree_size() > MAX_STEP_TOKENS:
                raise ValueError(f"strategies.{name}: one step can send {strat.max_tree_size()} tokens to the target, "
                                 f"more than the {MAX_STEP_TOKENS} a step takes; lower its budget / max_budget "
                                 "(or max_rounds x stage2_len)")
            if self.exact and strat.max_tree_size() > self.max_step():
                raise ValueError(f"strategies.{name}: one step can send {strat.max_tree_size()} tokens to the target; "
                                 f"on device: cuda every target step runs at one {self.max_step()}-token shape "
                                 f"(exactness: {self.exactness}, lossless there); lower its budget / max_budget (and "
                                 "max_rounds x stage2_len, or stage2: false), give buckets.tokens one larger size, "
                                 "or set exactness: plain (faster, not lossless on a GPU)")
            need = 2 + strat.max_rows()               # a prompt token, a new token, the largest step
            if need > self.max_seq_len:
                raise ValueError(f"strategies.{name}: one step can need {strat.max_rows()} KV rows beyond the "
                                 f"sequence, more than max_seq_len {self.max_seq_len}; lower its budget / "
                                 "max_budget or raise max_seq_len")
        return self

    def runs_with(self) -> dict:
        """What a strategy of this config runs with: strategies.strategy's keywords (a draft or none,
        the target's hidden rows or none, the kinds of head role, the most tokens a step takes)."""
        return {"has_draft": self.draft is not None, "has_hidden": self.target.hidden_rows,
                "heads": {h.kind for h in self.heads.values()}, "max_step": self.max_step()}

    @property
    def exact(self) -> bool:
        """Whether the target runs exact by one step shape (engines/exact.py, logical_engine.py): a torch
        target on a GPU."""
        return self.device == "cuda" and self.backend == "torch" and self.exactness != "plain"

    def step_buckets(self) -> dict:
        """The Batchers' buckets: the configured ones, or for an exact target its one token bucket
        (engines/exact.TOKENS unless configured) and one cache bucket (max_seq_len unless configured)."""
        b = self.buckets.model_dump()
        if self.exact:
            from ..engines.exact import TOKENS
            b = {"tokens": b["tokens"] or [TOKENS], "cache": b["cache"] or [self.max_seq_len]}
        return b

    def max_step(self) -> int:
        return max(self.step_buckets()["tokens"]) if self.exact else MAX_STEP_TOKENS

    def _check_heads(self) -> None:
        """Head roles: named apart from the other roles, one per kind, reading a target with hidden
        rows; their files resolved relative to the config file."""
        kinds = [h.kind for h in self.heads.values()]
        for name, head in self.heads.items():
            if name in RESERVED:
                raise ValueError(f"heads.{name}: {name!r} names another part of an engine folder; name the head "
                                 f"otherwise (not {', '.join(RESERVED)})")
            if kinds.count(head.kind) > 1:
                raise ValueError(f"heads: two heads of kind {head.kind}; a drafter asks its kind's one: keep one")
            if not self.target.hidden_rows:
                raise ValueError(f"heads.{name}: a head reads the target's hidden rows; set target.hidden_rows: "
                                 "true, or remove the head")
            if self.source and not Path(head.model).is_absolute():
                head.model = str((Path(self.source).parent / head.model).resolve())

    @classmethod
    def from_dict(cls, d: Any, source: str = "") -> "Config":
        where = source or "config"
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level")
        try:
            return cls.model_validate({**d, "source": source})
        except ValidationError as e:
            raise ConfigError(f"{where}: {one_line(e, '', _allowed_keys)}") from None

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def with_backend(self, backend: str | None) -> "Config":
        """This config with another backend, checked again (a backend brings its own rules)."""
        if backend is None or backend == self.backend:
            return self
        return Config.from_dict({**self.to_dict(), "backend": backend}, source=self.source)

    def digest(self) -> str:
        """Identifies what a build of this config produces (the engine cache key)."""
        keep = {k: v for k, v in self.to_dict().items() if k not in ("strategy", "strategies", "threads")}
        if not keep.get("heads"):
            keep.pop("heads", None)                   # as folders built before head roles
        for k in ("device", "cuda_graphs", "buckets", "slots", "prefix_cache", "exactness"):   # runtime choices
            keep.pop(k, None)
        from ..engines.quantize import exact_attention
        from .backends import BACKENDS         # torch quantizes at load; onnxruntime builds it into the graph
        for role in ("target", "draft"):
            if keep.get(role) and (keep[role].get("quantize") == "none" or BACKENDS[self.backend].quantizes_at_load):
                keep[role] = {k: v for k, v in keep[role].items() if k != "quantize"}
            # `attention: auto` builds what it resolves to: logical since 2026-12-07 (the folder of
            # `attention: logical`), where a folder from before, when auto was fp64, is another build
            if keep.get(role) and keep[role].get("attention") == "auto" and (
                    resolved := exact_attention(role, getattr(self, role))):
                keep[role] = {**keep[role], "attention": resolved}
            for key, default in (("activations", "auto"), ("hidden_rows", False), ("attention", "auto")):   # as before them
                if keep.get(role) and keep[role].get(key) == default:
                    keep[role] = {k: v for k, v in keep[role].items() if k != key}
        return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:16]


def _allowed_keys(parent: tuple) -> list[str]:
    """The keys a config section takes, for the error about an unknown one."""
    model: type = Config
    for part in parent:
        model = {"target": ModelEntry, "draft": ModelEntry, "tiny": TinyOptions, "build": BuildOptions,
                 "buckets": Buckets}.get(str(part), HeadEntry if model is Config and part not in Config.model_fields
                                         else model)
    return [k for k in model.model_fields if k != "source"]


def shipped_configs() -> list[str]:
    return sorted(q.stem for q in CONFIGS_DIR.glob("*.yaml"))


def load_config(path: str | Path | None) -> Config:
    """Read a YAML config; None = the default; a bare name = a config shipped with trtspec."""
    if path is None:
        path = DEFAULT_CONFIG
    p = Path(path)
    if not p.is_file() and (CONFIGS_DIR / f"{path}.yaml").is_file():
        p = CONFIGS_DIR / f"{path}.yaml"
    if not p.is_file():
        raise ConfigError(f"config {path} not found; give a YAML path or one of the shipped configs: "
                          f"{', '.join(shipped_configs())}")
    try:
        data = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: not valid YAML ({str(e).splitlines()[0]})") from None
    return Config.from_dict(data, source=str(p))
