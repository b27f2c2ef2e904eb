"""Seeded tiny random target/draft pairs: smoke tests and CI without any download.

Weights are drawn with a large enough scale that next-token distributions are peaked (random
models with the usual 0.02 init are near-uniform, which hides bugs behind argmax ties). The draft
is a noisy copy of the target, so it agrees with the target often enough for speculative decoding
to accept real runs of tokens (and to be rejected often enough to test the other branch).
"""
from __future__ import annotations

import torch

from .families import FAMILIES
from .model import Decoder
from .spec import ModelSpec


def tiny_spec(arch: str = "llama", vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
              num_heads: int = 4, num_kv_heads: int = 2, tie: bool = False, rotary_dim: int | None = None,
              window: int | None = None) -> ModelSpec:
    """A small spec of the family `arch`. `window`: every layer attends over that many keys; Gemma 3
    gets its own form (windowed and global layers alternating, the windowed ones over `window` or 12
    keys with their own rotary base, GeGLU, scores scaled by query_pre_attn_scalar = 24); Qwen3-MoE
    routes each token to 2 of 4 experts in every layer."""
    fam = FAMILIES[arch]
    form = dict(layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
                local_rope_theta=1000.0, query_pre_attn_scalar=24, hidden_act="gelu_pytorch_tanh",
                sliding_window=window or 12) if fam.local_rope_theta else {"sliding_window": window}
    if fam.experts:                     # Qwen3-MoE: 2 of 4 experts per token in every layer
        form.update(num_experts=4, experts_per_token=2, moe_intermediate_size=hidden_size, norm_topk_prob=True)
    return ModelSpec(arch=arch, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                     num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
                     head_dim=hidden_size // num_heads, rope_theta=10000.0,
                     attention_bias=fam.attention_bias, tie_word_embeddings=tie,
                     max_position_embeddings=4096, rotary_dim=rotary_dim, **form)


def random_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Decoder(spec).state_dict().items()}
    state = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):     # a scale of 1 (Gemma's norms scale by 1 + w)
            state[name] = torch.zeros(shape) if spec.family.norm_offset else torch.ones(shape)
        elif name.endswith("bias"):
            state[name] = 0.1 * torch.randn(shape, generator=gen)
        else:
            fan_in = shape[-1]
            scale = 1.0 if "embed" in name else 2.0 / fan_in ** 0.5
            state[name] = scale * torch.randn(shape, generator=gen)
    return state


def tiny_pair(spec: ModelSpec, seed: int = 0, draft_layers: int | None = None, noise: float = 0.05,
              dtype: torch.dtype = torch.float32) -> tuple[Decoder, Decoder]:
    """(target, draft) Decoders; the draft keeps the target's first `draft_layers` layers (default
    all), noised. A random truncated network disagrees with its full self almost always, so the
    default is a noisy full copy: ~50% acceptance at k=4, which exercises every verify branch."""
    draft_layers = draft_layers or spec.num_layers
    state = random_state(spec, seed)
    target = Decoder.from_state(spec, state, dtype)
    dspec = spec.first_layers(draft_layers)
    gen = torch.Generator().manual_seed(seed + 1)
    dstate = {}
    for k, v in state.items():
        if k.startswith("model.layers.") and int(k.split(".")[2]) >= draft_layers:
            continue
        dstate[k] = v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.dim() > 1 else v
    return target, Decoder.from_state(dspec, dstate, dtype)
