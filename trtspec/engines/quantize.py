"""Weight-only quantization: int4 / int8 ONNX graphs (onnxruntime), dynamic int8 drafts (torch).

ONNX Runtime: `quantize_onnx` runs ONNX Runtime's own `MatMulNBitsQuantizer` over the exported fp32
graph: every MatMul with a constant weight (q/k/v/o, gate/up/down, an untied LM head) becomes one
`com.microsoft.MatMulNBits` node holding block-wise weights, scales and zero points. We use that
op rather than standard blocked `DequantizeLinear` + `MatMul` because it is what ORT's CPU kernels
run (no fusion pass needed to get there). TensorRT would want the QDQ form instead; quantized
TensorRT plans are not built (refused in the config: never ran here).

The kernel's accuracy level is chosen per role, by what losslessness needs (docs/benchmarks.md,
"Why the int4 target keeps fp32 activations"):
- target: level 1, fp32 activations. Level 4 (int8 activations, 2x faster for one token) is
  bit-exact across row counts as an op, but in a whole model the ~1e-6 differences that attention
  makes between a tree forward and a one-token forward flip int8 roundings, and logits move by up
  to 0.7 (SmolLM2): a strategy's output would then not be the folder's own `ar`. At level 1 they
  stay at fp32's ~1e-5. ORT has no fast int8-weight kernel with fp32 activations (3.6 s per Qwen
  1.5B step), so an int8 *target* is refused; int4 it is.
- drafts: level 4, the fastest: a draft's numbers change acceptance, never the output.

A quantized target *is* the target: every strategy is lossless with respect to that engine's own
`ar` output. How often int4 greedy output agrees with fp32 is a quality note in
docs/benchmarks.md, not a guarantee. The scheme is recorded in the manifest (`quantize`).

Torch: `quantize_decoder` applies dynamic int8 to every Linear of a *draft* at load.
"""
from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import torch

from ..export.model import Decoder

BLOCK_SIZE = 32            # weights per scale along K (llama.cpp's Q4_0/Q8_0 use 32 too)
ACCURACY_LEVEL = {"target": 1, "draft": 4}   # fp32 / int8 activations in the kernel (see above)
SYMMETRIC = False          # a zero point per block, like Q4_K's mins
log = logging.getLogger(__name__)


def scheme(mode: str, role: str) -> dict:
    """What the manifest records about a quantized model."""
    import onnxruntime
    return {"mode": mode, "op": "com.microsoft.MatMulNBits", "bits": int(mode[3:]), "block_size": BLOCK_SIZE,
            "symmetric": SYMMETRIC, "accuracy_level": ACCURACY_LEVEL[role],
            "activations": "fp32" if ACCURACY_LEVEL[role] == 1 else "int8", "weights": "every MatMul with a constant "
            "weight (attention, MLP; the LM head unless tied to the embedding); embeddings and norms stay fp32",
            "quantizer": f"onnxruntime.quantization.MatMulNBitsQuantizer (onnxruntime {onnxruntime.__version__})"}


def quantize_onnx(src: Path, dst: Path, mode: str, role: str) -> dict:
    """Write `src` (an fp32 step graph of the target or a draft) as a weight-only int4/int8 graph at
    `dst` (external data if large); returns the manifest record: the scheme and the MatMul count."""
    import onnx
    from ..export.onnx_export import EXTERNAL_DATA_MIN_BYTES, remove_graph, save_graph
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    if mode not in ("int4", "int8"):
        raise ValueError(f"quantize mode {mode!r} is not int4 or int8")
    t0 = time.perf_counter()
    model = onnx.load(str(src))                     # with its external weights
    before = sum(n.op_type == "MatMul" for n in model.graph.node)
    q = MatMulNBitsQuantizer(model, bits=int(mode[3:]), block_size=BLOCK_SIZE, is_symmetric=SYMMETRIC,
                             accuracy_level=ACCURACY_LEVEL[role])
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)   # one INFO line per MatMul
    q.process()
    out = q.model.model
    nbits = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    if nbits == 0:
        raise RuntimeError(f"{src}: the quantizer found no MatMul with a constant weight to quantize")
    remove_graph(dst)
    save_graph(out, dst, external=sum(len(t.raw_data) for t in out.graph.initializer) > EXTERNAL_DATA_MIN_BYTES)
    log.info("quantized %s to %s: %d of %d MatMuls in %.1fs", src, mode, nbits, before, time.perf_counter() - t0)
    return {**scheme(mode, role), "matmuls_quantized": nbits, "matmuls_total": before}


def quantize_decoder(model: Decoder, mode: str) -> Decoder:
    """Torch backend, drafts only: dynamic int8 on every Linear (a draft's precision changes how often
    its guesses are accepted, never the output)."""
    if mode == "none":
        return model
    if mode != "int8":
        raise ValueError(f"the torch backend quantizes drafts to int8 only, not {mode!r}")
    if model.model.embed_tokens.weight.dtype != torch.float32:
        model = model.float()              # dynamic int8 kernels take float32 activations
        model.inv_freq = model.inv_freq.float()
    with warnings.catch_warnings():        # torch.ao prints a migration notice on every call
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
