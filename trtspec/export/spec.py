"""ModelSpec: the architecture facts every stage needs (export, engines, runtime).

One dataclass for every family (export/families/: Llama, Qwen2, Mistral, Qwen3, Phi-3, Gemma 3): they
differ in flags (attention bias, q/k norms, tied embeddings, rope scaling, partial rotary, sliding
windows, the activation), so the decoder is one class and the loaders fill this in; `spec.family`
holds the family's own facts.
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
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")                  # the feed-forward's gate activation
LAYER_TYPES = ("full_attention", "sliding_attention")        # transformers' names

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
    # per layer: "sliding_attention" (over the window) or "full_attention"; None: every layer alike
    layer_types: list[str] | None = None
    local_rope_theta: float | None = None  # the rotary base of windowed layers, unscaled (Gemma 3); None: rope_theta
    query_pre_attn_scalar: float | None = None   # attention scores scaled by its -1/2 power (None: head_dim's)
    hidden_act: str = "silu"
    # A mixture of experts (Qwen3-MoE): each token's MLP is its top `experts_per_token` of
    # `num_experts` experts of `moe_intermediate_size`, weighted by the router's probabilities
    # (renormalized over the chosen ones with `norm_topk_prob`); layers in `mlp_only_layers`, and all
    # but every `decoder_sparse_step`-th, keep a dense MLP. num_experts 0: a dense model.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    norm_weights_shifted: bool = False     # Gemma's norm weights hold 1 + w already (llama.cpp's GGUF)
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
        if self.hidden_act not in ACTIVATIONS:
            raise SpecError(f"activation {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types is not None and (len(self.layer_types) != self.num_layers
                                             or not set(self.layer_types) <= set(LAYER_TYPES)):
            raise SpecError(f"layer_types must name {self.num_layers} layers, each one of {', '.join(LAYER_TYPES)}; "
                            f"got {self.layer_types!r}")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or
                                                not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise SpecError(f"sliding_window must be a positive integer or null, got {self.sliding_window!r}")

        if self.num_experts and not (1 <= self.experts_per_token <= self.num_experts and self.moe_intermediate_size >= 1
                                     and self.decoder_sparse_step >= 1):
            raise SpecError(f"a mixture of experts needs 1 <= experts per token ({self.experts_per_token}) <= experts "
                            f"({self.num_experts}), a positive moe_intermediate_size and decoder_sparse_step")

    def first_layers(self, n: int) -> "ModelSpec":
        """The spec of this model's first `n` layers (a self-draft): per-layer facts cut to them."""
        return ModelSpec.from_dict({**self.to_dict(), "num_layers": n,
                                    "layer_types": self.layer_types[:n] if self.layer_types else None})

    def has_experts(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the routed experts (else a dense MLP)."""
        return bool(self.num_experts) and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def windowed(self, layer: int) -> bool:
        """Whether `layer` attends over the sliding window (the last `sliding_window` tokens)."""
        return bool(self.sliding_window) and (self.layer_types is None or self.layer_types[layer] == "sliding_attention")

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
        if isinstance(cfg.get("text_config"), dict):      # a multimodal checkpoint: its language model
            cfg = _text_config(cfg, family)
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        params = cfg.get("rope_parameters")  # transformers >= 5 nests rope settings here
        local_theta = cfg.get("rope_local_base_freq")
        if isinstance(params, dict) and "full_attention" in params:   # ... per layer type (Gemma 3)
            local = params.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise SpecError(f"rope scaling {local['rope_type']!r} of the sliding-window layers is not supported "
                                "(their rotary is unscaled in every Gemma 3)")
            local_theta, params = local_theta or local.get("rope_theta"), params["full_attention"] or {}
        if isinstance(params, dict):
            rope_theta = rope_theta or params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or params
        partial = cfg.get("partial_rotary_factor") or (params or {}).get("partial_rotary_factor") or 1.0
        if rope_scaling and cfg.get("original_max_position_embeddings"):     # Phi-3 keeps it beside
            rope_scaling = {"original_max_position_embeddings": cfg["original_max_position_embeddings"], **rope_scaling}
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(cap):
                raise SpecError(f"{cap} ({cfg[cap]}) is not supported: trtspec's attention and LM head have no "
                                "soft-capping (Gemma 2's); pick a model without it")
        if cfg.get("use_bidirectional_attention"):
            raise SpecError("use_bidirectional_attention: this is an embedding model (every token sees the whole "
                            "input), not a decoder trtspec can speculate on")
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
            rope_theta=float(rope_theta or family.rope_theta),
            rope_scaling=rope_scaling,
            attention_bias=bool(cfg.get("attention_bias", family.attention_bias)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family.tied)),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
            sliding_window=window,
            layer_types=_layer_types(cfg, window),
            local_rope_theta=float(local_theta or family.local_rope_theta) if family.local_rope_theta else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            **_experts(cfg, family),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def _layer_types(cfg: dict[str, Any], window: int | None) -> list[str] | None:
    """Which layers are windowed: config.json's `layer_types`, else what transformers derives (Gemma 3's
    `sliding_window_pattern`: every P-th layer global; Qwen2's layers from `max_window_layers` on);
    None where every layer is alike."""
    if not window:
        return None
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if cfg.get("model_type") == "gemma3_text":
        p = cfg.get("sliding_window_pattern", 6)
        return ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]
    if cfg.get("model_type") == "qwen2" and cfg.get("max_window_layers") is not None:
        return ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention" for i in range(n)]
    return None


def _text_config(cfg: dict[str, Any], family: Family) -> dict[str, Any]:
    """A multimodal config.json's language model (Gemma 3 4B-27B's `text_config`, which lists only
    what differs from its class's defaults), completed by transformers' own config class."""
    import transformers

    text = {k: v for k, v in cfg["text_config"].items() if k not in ("architectures", "transformers_version")}
    for key in ("tie_word_embeddings", "eos_token_id"):
        if key in cfg:
            text.setdefault(key, cfg[key])
    try:
        full = getattr(transformers, family.hf_config)(**text).to_dict()
    except (TypeError, ValueError) as e:
        raise SpecError(f"config.json's text_config is not a valid {family.hf_config}: {e}") from None
    return {**full, "model_type": family.hf_types[0]}


def _experts(cfg: dict[str, Any], family: Family) -> dict[str, Any]:
    """A mixture of experts' fields (none for a dense family)."""
    if not family.experts:
        return {}
    return dict(num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
                experts_per_token=cfg.get("num_experts_per_tok", 0), moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                mlp_only_layers=list(cfg.get("mlp_only_layers") or []))
