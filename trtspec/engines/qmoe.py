"""A mixture's experts on ONNX Runtime's quantized MoE kernel, one row per call (`quantize: int4`).

`experts_nodes` replaces one `trtspec.Experts` node of a weightless graph (export/experts_op.py) by

    Scan over the rows:  QMoE(row [1, H], its router logits [1, E])  ->  [1, H]

`com.microsoft.QMoE` routes (softmax over the logits, top k, renormalized where the model says so;
else weighted by the softmax over all experts, given as its router weights) and runs the chosen
experts' SwiGLU on 4-bit blocks (ONNX Runtime's MatMulNBitsQuantizer, the same blocks as every other
product of the build: 32 weights per scale and zero point along K; gate and up interleaved row by row
as fc1, down as fc2). Its 8-bit form does not read MatMulNBits' 8-bit blocks as they dequantize
(measured: outputs ~1e-2 off the module on those weights), so `quantize: int8` keeps experts fp32.

QMoE groups a call's rows by expert, and a row's result then depends on which other rows share the
call (measured: 4 of 16 random rows differ from the same row alone, one thread or two); one row per
call makes each row's arithmetic the same as the same token's alone, so a tree row is exact by
construction, at the kernel's speed (a Qwen3-30B-A3B-shaped layer: 1.5 ms a row against 16.9 ms for
the fp32 gather form; lab/moe_tree_cost.py, docs/benchmarks.md "Quantized experts").
"""
from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto, helper, numpy_helper

from ..export.experts_op import DOMAIN, OP
from .manifest import EngineError
from .quantize import BLOCK_SIZE, quantize_matmul


BITS = 4


def is_experts(node) -> bool:
    return node.domain == DOMAIN and node.op_type == OP


def experts_nodes(node, weights, spec, accuracy_level: int):
    """(nodes, initializers) computing the experts of the layer `node` names, from `weights`."""
    layer = next(a.i for a in node.attribute if a.name == "layer")
    key = f"model.layers.{layer}.mlp.experts."
    e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    if h % BLOCK_SIZE or i % BLOCK_SIZE:
        raise EngineError(f"ONNX Runtime's QMoE needs the hidden size ({h}) and the experts' width ({i}) in whole "
                          f"blocks of {BLOCK_SIZE}; build this model with quantize: none or gguf")
    p = f"experts/{layer}/"
    gate, up = weights.get(key + "gate_proj", torch.float32), weights.get(key + "up_proj", torch.float32)
    fc1 = torch.stack([gate, up], 2).reshape(e * 2 * i, h).numpy()       # rows gate 0, up 0, gate 1, up 1, ...
    del gate, up
    inits = _quantized(fc1, e, accuracy_level, p + "fc1")
    del fc1
    inits += _quantized(weights.get(key + "down_proj", torch.float32).reshape(e * h, i).numpy(), e, accuracy_level,
                        p + "fc2")
    inits += [numpy_helper.from_array(np.array([0], dtype=np.int64), p + "axis"),
              numpy_helper.from_array(np.array([-1, h], dtype=np.int64), p + "rows"),
              numpy_helper.from_array(np.array([-1, e], dtype=np.int64), p + "logit_rows")]
    inputs = [p + "x1", p + "l1", p + "fc1", p + "fc1_scales", "", p + "fc2", p + "fc2_scales", "", "", "", "",
              p + "fc1_zero_points", p + "fc2_zero_points"]
    first = [helper.make_node("Unsqueeze", [p + "xr", p + "axis"], [p + "x1"]),
             helper.make_node("Unsqueeze", [p + "lr", p + "axis"], [p + "l1"])]
    if not spec.norm_topk_prob:     # the chosen experts weighted by their softmax over all experts, as given
        first.append(helper.make_node("Softmax", [p + "l1"], [p + "p1"], axis=-1))
        inputs += ["", p + "p1"]
    qmoe = helper.make_node(
        "QMoE", inputs, [p + "y1"], domain="com.microsoft", name=p + "qmoe",
        k=spec.experts_per_token, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
        activation_beta=0.0, normalize_routing_weights=int(spec.norm_topk_prob), expert_weight_bits=BITS,
        block_size=BLOCK_SIZE, accuracy_level=accuracy_level)
    body = helper.make_graph(
        [*first, qmoe, helper.make_node("Squeeze", [p + "y1", p + "axis"], [p + "yr"])], f"{p}row",
        [helper.make_tensor_value_info(p + "xr", TensorProto.FLOAT, [h]),
         helper.make_tensor_value_info(p + "lr", TensorProto.FLOAT, [e])],
        [helper.make_tensor_value_info(p + "yr", TensorProto.FLOAT, [h])])
    x, logits = node.input
    nodes = [helper.make_node("Shape", [x], [p + "shape"], name=p + "shape"),
             helper.make_node("Reshape", [x, p + "rows"], [p + "x"], name=p + "x"),
             helper.make_node("Reshape", [logits, p + "logit_rows"], [p + "l"], name=p + "l"),
             helper.make_node("Scan", [p + "x", p + "l"], [p + "y"], name=p + "scan", num_scan_inputs=2, body=body),
             helper.make_node("Reshape", [p + "y", p + "shape"], [node.output[0]], name=p + "y")]
    return nodes, inits


def _quantized(w: np.ndarray, experts: int, accuracy_level: int, name: str) -> list:
    """QMoE's weights, scales and zero points [E, N, ...] of `w` [E * N, K] (each row's blocks along K),
    from ONNX Runtime's MatMulNBitsQuantizer (MatMulNBits' layout is QMoE's, row by row)."""
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name=name)
    new = quantize_matmul(node, w.T, BITS, accuracy_level)
    if new is None:
        raise RuntimeError(f"onnxruntime's quantizer kept {name} dense; this onnxruntime release changed it")
    parts = {}
    for t in new[1]:
        a = numpy_helper.to_array(t)
        kind = "scales" if t.name.endswith("_scales") else "zero_points" if t.name.endswith("_zero_points") else "w"
        parts[kind] = a.reshape(experts, w.shape[0] // experts, -1)
    return [numpy_helper.from_array(np.ascontiguousarray(parts["w"]), name),
            numpy_helper.from_array(np.ascontiguousarray(parts["scales"]), name + "_scales"),
            numpy_helper.from_array(np.ascontiguousarray(parts["zero_points"]), name + "_zero_points")]
