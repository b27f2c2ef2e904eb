"""ModelSpec: the architecture facts every stage needs (export, engines, runtime).

One dataclass for every family (export/families/: Llama, Qwen2, Mistral, Qwen3, Phi-3): they differ
in flags (attention bias, q/k norms, tied embeddings, rope scaling, partial rotary), so the decoder is one class and
the loaders fill this in; `spec.family` holds the family's own facts.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import TrtspecError
from .families import FAMILIES, Family, by_hf_type

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}   # config names -> torch

SUPPORTED_ARCHS = tuple(FAMILIES)


class SpecError(TrtspecError, ValueError):
    """A checkpoint or config that trtspec cannot use; the message names the problem and the fix."""


@dataclass
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    rotary_dim: int | None = None          # rotary over the first rotary_dim dims of each head (None: all)
    sliding_window: int | None = None      # keys a token sees, itself included, where the model limits them
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise SpecError(
                f"unsupported architecture {self.arch!r}: trtspec supports {', '.join(SUPPORTED_ARCHS)} "
                "decoder-only models; convert the checkpoint to one of them or pick another model")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            try:
                ok = operator.index(value) >= 1 and not isinstance(value, bool)
            except TypeError:
                ok = False
            if not ok:
                raise SpecError(f"model {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelSpec":
        """Build from a Hugging Face config.json dict."""
        model_type = cfg.get("model_type", "")
        family = by_hf_type(model_type)
        if family is None:
            raise SpecError(
                f"unsupported architecture {model_type!r} (config.json model_type): trtspec supports "
                f"{', '.join(SUPPORTED_ARCHS)}")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers >= 5 nests rope settings here
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        partial = cfg.get("partial_rotary_factor") or (params or {}).get("partial_rotary_factor") or 1.0
        if rope_scaling and cfg.get("original_max_position_embeddings"):     # Phi-3 keeps it beside
            rope_scaling = {"original_max_position_embeddings": cfg["original_max_position_embeddings"], **rope_scaling}
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        return cls(
            arch=family.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
            sliding_window=window,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
