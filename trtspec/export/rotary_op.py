"""Rotary embedding as one node, for graphs ONNX Runtime runs (`Decoder.fused_rotary()`).

The plain export writes q·cos + rotate_half(q)·sin as six nodes per tensor (Mul, Split, Neg, Concat,
Mul, Add); a quantized build's graph, which only ONNX Runtime runs, writes it as one
`com.microsoft.RotaryEmbedding` instead (`TRANSLATION`), twice per layer. Its cos/sin caches are the
step's own rows: the decoder computes each new row's (cos, sin) once per step ([B·T, R/2], fp32 as
transformers does, times yarn's factor), and `rows` [B, T] indexes them, so no table of every
position is stored. In torch, `rotary` computes the same formula as Attention.project's plain form.
"""
from __future__ import annotations

import torch


@torch.library.custom_op("trtspec::rotary", mutates_args=())
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor, heads: int,
           dim: int) -> torch.Tensor:
    """x [B, T, heads·D] rotated over the first `dim` (R) features of each head; cos, sin [B·T, R/2]
    the rows' halves, rows [B, T] each row's index into them."""
    b, t = rows.shape
    half = dim // 2
    c, s = cos[rows].unsqueeze(2), sin[rows].unsqueeze(2)                   # [B, T, 1, R/2]
    xh = x.view(b, t, heads, -1)
    x1, x2, rest = xh[..., :half], xh[..., half:2 * half], xh[..., 2 * half:]
    out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], -1)
    return out.reshape(x.shape)


@rotary.register_fake
def _(x, cos, sin, rows, heads, dim):
    return torch.empty_like(x)


def _translate(x, cos, sin, rows, heads: int, dim: int):
    import onnxscript
    from onnx.defs import OpSchema
    p, a = OpSchema.FormalParameter, OpSchema.Attribute
    schema = OpSchema("RotaryEmbedding", "com.microsoft", 1,
                      inputs=[p("input", "T"), p("position_ids", "M"), p("cos_cache", "T"), p("sin_cache", "T")],
                      outputs=[p("output", "T")],
                      type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], ""),
                                        ("M", ["tensor(int64)"], "")],
                      attributes=[a("num_heads", OpSchema.AttrType.INT, ""),
                                  a("rotary_embedding_dim", OpSchema.AttrType.INT, ""),
                                  a("interleaved", OpSchema.AttrType.INT, "")])
    op = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "RotaryEmbedding", schema)
    return op(x, rows, cos, sin, num_heads=heads, rotary_embedding_dim=dim, interleaved=0)


TRANSLATION = {torch.ops.trtspec.rotary.default: _translate}     # torch.onnx.export's custom_translation_table
