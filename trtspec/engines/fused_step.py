"""The logical engine's decoder step in a few kernels (issue 61, part 3).

The same weights and the same arithmetic as export/model.py's Decoder, written as ten kernels a
layer on a GPU:

    add + RMSNorm (fused_blocks) . q/k/v as one product . rotary + the KV write into the pool
    (fused_blocks; a Qwen3 q/k norm inside) . attention by logical order (logical_attention: two;
    a sliding window by logical position) . o_proj . add + RMSNorm . gate/up as one product
    . SiLU * up (fused_blocks; Gemma's GeGLU) . down_proj

(Gemma's sandwich norms add two norm kernels) and, once a step, the LM head on the logit rows
only. A joined product is the separate products' columns side by side, run like every product at
the step bucket's one shape and without split-K (engines/exact.py), and every other kernel reduces
within one row, so a tree row's arithmetic is still the same token's decoded alone (its last bits
may differ from the separate products' where a GPU picks other tiles: outputs equal the eager
Decoder's within tolerance, not bit for bit). MoE layers keep their own module for the feed-forward
half.

`join(model)` joins the weights in place: q_proj / k_proj / v_proj (gate_proj / up_proj) become
views into one tensor, so the Decoder's own forward reads the same values and no second copy of the
weights is made. Checked on the CPU under TRITON_INTERPRET=1 against the eager Decoder
(tests/e2e/test_fused_step.py: logits, kernels per layer); the device check's profile counts the
kernels on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..export.model import MLP, Decoder
from .fused_blocks import act_mul, add_rms_norm, rope_write
from .logical_attention import logical_attention


@dataclass
class Joined:
    """One layer's joined products: q/k/v [(H + 2 Hkv) D, E] (+ bias), gate/up [2I, E] (None: the
    layer's own feed-forward module), q/k norm weights [2D] with their norm (None without), and its
    attention's sliding window (0: none)."""
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    gate_up: torch.Tensor | None
    qk_norm: tuple[torch.Tensor, nn.Module] | None
    window: int


def _views(mods: list[nn.Linear]) -> torch.Tensor:
    """The modules' weights as one tensor, their parameters made views into it (no second copy)."""
    joined = torch.cat([m.weight for m in mods])
    for m, part in zip(mods, joined.split([m.weight.shape[0] for m in mods])):
        m.weight = nn.Parameter(part, requires_grad=False)
    return joined


def join(model: Decoder) -> list[Joined]:
    out = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
        gate_up = _views([mlp.gate_proj, mlp.up_proj]) if isinstance(mlp, MLP) else None
        qk = (torch.cat([a.q_norm.weight, a.k_norm.weight]), a.q_norm) if hasattr(a, "q_norm") else None
        out.append(Joined(_views([a.q_proj, a.k_proj, a.v_proj]), bias, gate_up, qk,
                          model.spec.sliding_window if layer.windowed else 0))
    return out


def fused_step(model: Decoder, joined: list[Joined], ids, pos, rows, pool, slot, write, prefix, tail, ntail):
    """One step over the pool in place: the logits [B, R, V] (fp32) of the logit rows `rows` [B, R],
    and their hidden rows after the final norm (fp32) where the model returns them, else None.
    ids, pos [B, T]; pool [L, 2, slots, Hkv, S, D]; per row (B·T): slot, write (the pool row its new
    K/V go to), prefix / tail / ntail (its keys in logical order: logical_attention)."""
    spec, body = model.spec, model.model
    b, t = ids.shape
    x = body.embed_tokens(ids).view(b * t, -1)
    if spec.family.embed_scale:                   # Gemma: times sqrt(hidden), in x's dtype
        x = x * torch.tensor(spec.hidden_size ** 0.5, dtype=x.dtype)
    rope = {False: model.rotary(model.inv_freq, pos, x.dtype, model.rope_scale)}
    if hasattr(model, "local_inv_freq"):          # Gemma 3: the windowed layers' own rotary base, unscaled
        rope[True] = model.rotary(model.local_inv_freq, pos, x.dtype)
    rope = {w: tuple(r.reshape(b * t, -1) for r in pair) for w, pair in rope.items()}
    heads = (spec.num_heads, spec.num_kv_heads, spec.head_dim)
    h = None
    for i, (layer, j) in enumerate(zip(body.layers, joined)):
        x, y = add_rms_norm(x, h, layer.input_layernorm)
        k, v, attn = pool[i, 0], pool[i, 1], layer.self_attn
        cos, sin = rope.get(layer.windowed, rope[False])
        q = rope_write(F.linear(y, j.qkv, j.qkv_bias), cos, sin, heads, j.qk_norm, k, v, slot, write, pool.dtype)
        h = attn.o_proj(logical_attention(q, k, v, slot, prefix, tail, ntail, scale=attn.scale, window=j.window)
                        .view(b * t, -1).to(x.dtype))
        if layer.sandwich:                        # Gemma: each block's output normed before its residual
            _, h = add_rms_norm(h, None, layer.post_attention_layernorm)
        x, y = add_rms_norm(x, h, layer.pre_feedforward_layernorm if layer.sandwich else layer.post_attention_layernorm)
        h = (layer.mlp.down_proj(act_mul(F.linear(y, j.gate_up), layer.mlp.tanh_gelu)) if j.gate_up is not None
             else layer.mlp(y.view(b, t, -1)).view(b * t, -1))
        if layer.sandwich:
            _, h = add_rms_norm(h, None, layer.post_feedforward_layernorm)
    at = rows.unsqueeze(-1).expand(-1, -1, x.shape[-1])                      # [B, R, E]
    x = torch.gather((x + h).view(b, t, -1), 1, at).contiguous()
    _, y = add_rms_norm(x, None, body.norm)
    return model.lm_head(y).float(), (y.float() if model.hidden_rows else None)
