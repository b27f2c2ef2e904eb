"""Family: the facts of one model family (export/families/__init__.py has the registry)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, NamedTuple


@dataclass(frozen=True)
class Family:
    name: str                              # ModelSpec.arch
    hf_types: tuple[str, ...]              # config.json model_type values it reads
    hf_config: str                         # transformers' config class: the oracle and the HF peers
    hf_model: str                          # transformers' causal LM class
    gguf: str | None = None                # llama.cpp's general.architecture (None: no GGUF path yet)
    attention_bias: bool = False           # q/k/v biases when config.json does not say
    qk_norm: bool = False                  # an RMSNorm over each head of q and of k, before rotary
    gguf_rope_permuted: bool = False       # llama.cpp's converter permutes q/k rows (GPT-J rope)
    rope_theta: float = 10000.0            # the rotary base when config.json gives none
    tied: bool = False                     # the LM head is the embedding when config.json does not say
    # Gemma's: the rotary base of windowed layers when config.json gives none (None: one rotary for all)
    local_rope_theta: float | None = None
    norm_offset: bool = False              # RMSNorm scales by (1 + w), in fp32 before the cast (Gemma)
    embed_scale: bool = False              # embeddings times sqrt(hidden_size), in the weights' dtype (Gemma)
    # Gemma's four norms per layer: the attention's and the feed-forward's outputs are normed too
    # (post_attention_layernorm is then the attention output's; pre_feedforward_layernorm the MLP input's)
    sandwich_norms: bool = False
    # routed experts (Qwen3-MoE): the checkpoint's `mlp.experts.N.<proj>.weight` are stacked by N into
    # the Decoder's `mlp.experts.<proj>` [experts, out, in]; the router is `mlp.gate`
    experts: bool = False
    # GGUF tensor names (the part after blk.N.) that mean another Decoder weight in this family than
    # in llama's (gguf_loader._LAYER_NAMES): Gemma's ffn_norm is its pre-feed-forward norm
    gguf_names: tuple[tuple[str, str], ...] = ()
    # checkpoint tensors that hold several Decoder weights, stacked by rows (Phi-3's qkv_proj and
    # gate_up_proj): (the joined module's name, the Decoder modules it holds, in order)
    joined: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # a multimodal checkpoint's decoder (Gemma 3 4B-27B): its prefixes, as (checkpoint's, Decoder's);
    # tensors under `foreign` prefixes (the vision tower) are not the decoder's and are left unread
    renamed: tuple[tuple[str, str], ...] = ()
    foreign: tuple[str, ...] = ()
    # what the transformers config needs beyond the common fields, or why a spec has none (a str)
    hf_extra: Callable[[object], dict | str] = field(default=lambda spec: {})


class Part(NamedTuple):
    """Where a checkpoint tensor goes in the Decoder: `name`, its rows `rows` of it (None: all of it),
    or, for an expert's weight, the expert index `expert` of the stacked tensor `name`."""
    name: str
    rows: slice | None = None
    expert: int | None = None


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def decoder_names(spec, key: str) -> list[Part]:
    """The Decoder weights that the checkpoint tensor `key` holds: none for a tensor of another part
    of a multimodal checkpoint, the Decoder's name for one under its language model's prefix, each
    part of a joined one, an expert's place in its stacked tensor."""
    fam = spec.family
    if fam.foreign and key.startswith(fam.foreign):
        return []
    for old, new in fam.renamed:
        if key.startswith(old):
            key = new + key[len(old):]
            break
    if fam.experts and (m := _EXPERT.match(key)):
        return [Part(f"{m.group(1)}.{m.group(3)}", expert=int(m.group(2)))]
    return [Part(name, slice(a, b)) for name, a, b in unjoined(spec, key) or []] or [Part(key)]


def unjoined(spec, key: str) -> list[tuple[str, int, int]] | None:
    """The Decoder weights that the checkpoint's joined tensor `key` holds, as (name, first row, end
    row); None where `key` is no joined tensor of the spec's family."""
    rows = {"self_attn.q_proj": spec.num_heads * spec.head_dim, "self_attn.k_proj": spec.num_kv_heads * spec.head_dim,
            "self_attn.v_proj": spec.num_kv_heads * spec.head_dim, "mlp.gate_proj": spec.intermediate_size,
            "mlp.up_proj": spec.intermediate_size}
    for joined, parts in spec.family.joined:
        if key.endswith(f".{joined}.weight"):
            prefix, start, out = key[:-len(f"{joined}.weight")], 0, []
            for part in parts:
                out.append((f"{prefix}{part}.weight", start, start + rows[part]))
                start += rows[part]
            return out
    return None


def hf_window(spec, per_layer: bool) -> dict | str:
    """The sliding window as a transformers config of the family takes it: `layer_types` beside it
    where the family's config has them (`per_layer`), else one window for every layer (or why not)."""
    if not spec.sliding_window:
        return {"sliding_window": None, **({"use_sliding_window": False} if per_layer else {})}
    types = spec.layer_types or ["sliding_attention"] * spec.num_layers
    if per_layer:
        return {"sliding_window": spec.sliding_window, "use_sliding_window": True, "layer_types": types,
                "max_window_layers": types.index("sliding_attention") if "sliding_attention" in types else spec.num_layers}
    if "full_attention" in types:
        return f"a {spec.arch} spec with windowed and global layers has no transformers equivalent"
    return {"sliding_window": spec.sliding_window}
