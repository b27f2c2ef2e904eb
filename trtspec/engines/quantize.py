"""Weight-only quantization: int4 / int8 ONNX graphs (onnxruntime), dynamic int8 drafts (torch).

ONNX Runtime: `quantize_matmul` runs ONNX Runtime's own `MatMulNBitsQuantizer` on each MatMul with
a weight as the streaming build writes it (engines/stream.py): every one (q/k/v/o, gate/up/down, the
LM head) becomes one `com.microsoft.MatMulNBits` node holding block-wise weights, scales and zero
points. We use that
op rather than standard blocked `DequantizeLinear` + `MatMul` because it is what ORT's CPU kernels
run (no fusion pass needed to get there). TensorRT would want the QDQ form instead; quantized
TensorRT plans are not built (refused in the config: never ran here).

The kernel's accuracy level follows `activations:` (docs/design.md, "Exact attention"):
- fp32 (level 1; a target's default): tree rows stay within fp32's ~1e-5 of one-token rows.
- int8 (level 4; a draft's default, ~1.7x faster per target step): a lone MatMulNBits gives
  bit-identical rows whatever the row count, but attention over the rows as they lie rounds a tree
  forward and a one-token forward differently (~1e-6), and per-block int8 quantization of o_proj's
  input turns that into logits 0.3-0.7 apart. A target at int8 therefore gets exact attention
  (`exact_attention`: fp64 attention and KV, or with `attention: logical` each row's keys in logical
  order in fp32, export/model.py `Attention.logical`), so tree rows give one-token rows' logits bit
  for bit (`inspect --compare --trees N` counts them). ORT has no fast int8-weight kernel with fp32 activations (3.6 s per Qwen 1.5B step), so an
  int8 target needs int8 activations.
- a draft's numbers change acceptance, never the output.

A quantized target *is* the target: every strategy is lossless with respect to that engine's own
`ar` output. How often int4 greedy output agrees with fp32 is a quality note in
docs/benchmarks.md, not a guarantee. The scheme is recorded in the manifest (`quantize`).

Torch: `quantize_decoder` applies dynamic int8 to every Linear of a *draft* at load.
"""
from __future__ import annotations

import logging
import warnings

import torch

from ..export.model import Decoder

BLOCK_SIZE = 32            # weights per scale along K (llama.cpp's Q4_0/Q8_0 use 32 too)
ACCURACY_LEVEL = {"fp32": 1, "int8": 4}      # MatMulNBits' accuracy level per activation precision
DEFAULT_ACTIVATIONS = {"target": "fp32", "draft": "int8"}   # `activations: auto` (see above)
SYMMETRIC = False          # a zero point per block, like Q4_K's mins
log = logging.getLogger(__name__)


def activations(role: str, entry) -> str:
    """fp32 or int8: what a model entry's quantized MatMuls do with their activations."""
    return DEFAULT_ACTIVATIONS[role] if entry.activations == "auto" else entry.activations


def exact_attention(role: str, entry) -> str:
    """"fp64" or "logical" where a model's attention must be exact, else "": a quantized target with
    int8 activations, so that each row's attention output does not depend on the rows sharing its
    forward; without it, int8 roundings of o_proj's input turn fp32's ~1e-6 differences into logits
    0.3-0.7 apart. logical (auto): each row's keys in the order sequential decoding reads them, in
    fp32 (export/model.py Attention.logical); fp64 (`attention: fp64`): attention and KV in fp64."""
    if not (role == "target" and entry.quantize != "none" and activations(role, entry) == "int8"):
        return ""
    return "fp64" if entry.attention == "fp64" else "logical"


def fused_experts(spec, mode: str) -> bool:
    """Whether a build's mixture runs its experts on ONNX Runtime's quantized MoE kernel (int4:
    engines/qmoe.py) rather than as the exported products (fp32 at int8; a GGUF's own blocks, gathered)."""
    return mode == "int4" and bool(spec.num_experts)


def fused_ops(spec, mode: str) -> tuple[str, ...]:
    """What a build's graph exports as one node each: rotary as com.microsoft.RotaryEmbedding in every
    quantized build (only ONNX Runtime runs those: export/rotary_op.py), and the experts where
    fused_experts."""
    return ("rotary",) * (mode != "none") + ("experts",) * fused_experts(spec, mode)


def scheme(mode: str, acts: str) -> dict:
    """What the manifest records about a quantized model."""
    import onnxruntime
    return {"mode": mode, "op": "com.microsoft.MatMulNBits", "bits": int(mode[3:]), "block_size": BLOCK_SIZE,
            "symmetric": SYMMETRIC, "accuracy_level": ACCURACY_LEVEL[acts],
            "activations": acts, "weights": "every MatMul with a constant "
            "weight (attention, MLP; the LM head unless tied to the embedding); norms stay fp32, and embeddings "
            "too unless the source stores them in blocks (a GGUF: gathered from its blocks, bit for bit); a "
            "mixture's experts in the same blocks on ONNX Runtime's QMoE, one row per call (int4; fp32 at int8)",
            "quantizer": f"onnxruntime.quantization.MatMulNBitsQuantizer (onnxruntime {onnxruntime.__version__})"}


def record(mode: str, acts: str, counts: dict) -> dict:
    """The manifest's `quantize` record of a graph written by engines/stream.py."""
    import onnxruntime
    if mode != "gguf":
        return {**scheme(mode, acts), **{k: counts[k] for k in ("matmuls_quantized", "matmuls_total", "joined_products",
                                                                "embedding", "experts_quantized", "experts_total",
                                                                "experts") if k in counts}}
    return {"mode": "gguf", "op": "com.microsoft.MatMulNBits", "bits": 4, "block_size": "the GGUF's (16 or 32)",
            "symmetric": False, "accuracy_level": ACCURACY_LEVEL[acts], "activations": acts,
            "weights": "the GGUF's block codes, scales and mins: 4-bit terms per nibble of the codes (8-bit "
                       "terms for wider codes at int8 activations), the mins as block sums times offsets, "
                       "weights of one input with one block type joined into one product, the embedding "
                       "gathered from its blocks (and a tied LM head run from them); the engine's weights "
                       "equal gguf.quants.dequantize bit for bit",
            "quantizer": f"trtspec.engines.gguf_blocks (onnxruntime {onnxruntime.__version__})", **counts}


COLUMNS = 16384            # a weight's columns quantized at once (the quantizer copies its input a few times)


def quantize_matmul(node, weight, bits: int, accuracy_level: int, columns: int = COLUMNS):
    """(nodes, initializers) of ONNX Runtime's MatMulNBitsQuantizer for one MatMul `node` whose B is
    `weight` [K, N], or None where it keeps the MatMul. The quantizer runs on a graph of that node
    alone (a streaming build quantizes one weight at a time), over `columns` columns at a time: each
    column's blocks are quantized on their own and every output is column-major, so the slices'
    outputs joined are the whole weight's, byte for byte (tests/e2e/test_stream.py)."""
    import numpy as np
    from onnx import numpy_helper

    parts = [_quantize_columns(node, np.ascontiguousarray(weight[:, i:i + columns]), bits, accuracy_level)
             for i in range(0, weight.shape[1], columns)]
    if any(p is None for p in parts):
        return None
    nodes, inits = parts[0]
    if len(parts) > 1:
        for nd in nodes:
            for a in nd.attribute:
                if nd.op_type == "MatMulNBits" and a.name == "N":
                    a.i = weight.shape[1]
        joined = []
        for i, init in enumerate(inits):
            arrays = [numpy_helper.to_array(p[1][i]) for p in parts]
            joined.append(numpy_helper.from_array(np.concatenate(arrays, axis=0), init.name))
        inits = joined
    return nodes, inits


def _quantize_columns(node, weight, bits: int, accuracy_level: int):
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    g = helper.make_graph([node], "one", [helper.make_tensor_value_info(node.input[0], onnx.TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info(node.output[0], onnx.TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(weight, node.input[1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    q = MatMulNBitsQuantizer(m, bits=bits, block_size=BLOCK_SIZE, is_symmetric=SYMMETRIC, accuracy_level=accuracy_level)
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    q.process()
    out = q.model.model.graph
    if not any(n.op_type == "MatMulNBits" for n in out.node):
        return None
    # Copies: a message taken from a protobuf keeps its whole parent alive, the fp32 weight included
    return ([type(n).FromString(n.SerializeToString()) for n in out.node],
            [type(t).FromString(t.SerializeToString()) for t in out.initializer])


def quantize_decoder(model: Decoder, mode: str) -> Decoder:
    """Torch backend, drafts only: dynamic int8 on every Linear (a draft's precision changes how often
    its guesses are accepted, never the output)."""
    if mode == "none":
        return model
    if mode != "int8":
        raise ValueError(f"the torch backend quantizes drafts to int8 only, not {mode!r}")
    if model.model.embed_tokens.weight.dtype != torch.float32:
        model = model.float()              # dynamic int8 kernels take float32 activations
        model.reset_rotary()
    with warnings.catch_warnings():        # torch.ao prints a migration notice on every call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
