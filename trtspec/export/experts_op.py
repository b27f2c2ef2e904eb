"""A mixture's experts as one node of the exported graph, for builds that compute them elsewhere.

`Decoder.fused_experts()` makes each MoE layer call `experts(x, router_logits, layer)`, a torch custom
op that only exports: torch.onnx writes it as one `trtspec.Experts` node (`TRANSLATION`), inputs the
layer's normed rows and its router's logits, attribute the layer's index. The streaming build
(engines/stream.py) then replaces that node by what runs the experts, with the checkpoint's weights
quantized (engines/qmoe.py: ONNX Runtime's QMoE, one row per call). The node never reaches an engine.
"""
from __future__ import annotations

import torch

DOMAIN, OP = "trtspec", "Experts"


@torch.library.custom_op("trtspec::experts", mutates_args=())
def experts(x: torch.Tensor, router_logits: torch.Tensor, layer: int) -> torch.Tensor:
    raise RuntimeError("trtspec::experts only exports (a quantized build replaces it); run the Decoder without "
                       "fused_experts()")


@experts.register_fake
def _(x, router_logits, layer):
    return torch.empty_like(x)


def _translate(x, router_logits, layer: int):
    import onnxscript
    from onnx.defs import OpSchema
    schema = OpSchema(OP, DOMAIN, 1, inputs=[OpSchema.FormalParameter("x", "T"),
                                             OpSchema.FormalParameter("router_logits", "T")],
                      outputs=[OpSchema.FormalParameter("y", "T")],
                      type_constraints=[("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "")],
                      attributes=[OpSchema.Attribute("layer", OpSchema.AttrType.INT, "the MoE layer's index")])
    return onnxscript.values.Op(onnxscript.values.Opset(DOMAIN, 1), OP, schema)(x, router_logits, layer=layer)


TRANSLATION = {torch.ops.trtspec.experts.default: _translate}     # torch.onnx.export's custom_translation_table
