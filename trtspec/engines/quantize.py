"""Weight-only quantization: int4 / int8 ONNX graphs (onnxruntime), dynamic int8 drafts (torch).

ONNX Runtime: `quantize_onnx` runs ONNX Runtime's own `MatMulNBitsQuantizer` over the exported fp32
graph: every MatMul with a constant weight (q/k/v/o, gate/up/down, an untied LM head) becomes one
`com.microsoft.MatMulNBits` node holding block-wise weights, scales and zero points. We use that
op rather than standard blocked `DequantizeLinear` + `MatMul` because it is what ORT's CPU kernels
run (no fusion pass needed to get there). TensorRT would want the QDQ form instead; quantized
TensorRT plans are not built (refused in the config: never ran here).

The kernel's accuracy level follows `activations:` (docs/ARCHITECTURE.md, "Exact attention"):
- fp32 (level 1; a target's default): tree rows stay within fp32's ~1e-5 of one-token rows.
- int8 (level 4; a draft's default, ~1.7x faster per target step): a lone MatMulNBits gives
  bit-identical rows whatever the row count, but in fp32 attention a tree forward and a one-token
  forward round differently (~1e-6), and per-block int8 quantization of o_proj's input turns that
  into logits 0.3-0.7 apart. A target at int8 therefore gets exact attention (`exact_attention`,
  export/model.py): fp64 attention and KV, whose differences (~1e-16) vanish when its output is
  rounded to fp32, so tree rows give one-token rows' logits bit for bit (`inspect --compare
  --trees N` counts them). ORT has no fast int8-weight kernel with fp32 activations (3.6 s per
  Qwen 1.5B step), so an int8 target needs int8 activations.
- a draft's numbers change acceptance, never the output.

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
ACCURACY_LEVEL = {"fp32": 1, "int8": 4}      # MatMulNBits' accuracy level per activation precision
DEFAULT_ACTIVATIONS = {"target": "fp32", "draft": "int8"}   # `activations: auto` (see above)
SYMMETRIC = False          # a zero point per block, like Q4_K's mins
log = logging.getLogger(__name__)


def activations(role: str, entry) -> str:
    """fp32 or int8: what a model entry's quantized MatMuls do with their activations."""
    return DEFAULT_ACTIVATIONS[role] if entry.activations == "auto" else entry.activations


def exact_attention(role: str, entry) -> bool:
    """A quantized target with int8 activations runs its attention (and KV) in fp64, so that each row's
    attention output, rounded to fp32, does not depend on the rows sharing its forward; without it,
    int8 roundings of o_proj's input turn fp32's ~1e-6 differences into logits 0.3-0.7 apart."""
    return role == "target" and entry.quantize != "none" and activations(role, entry) == "int8"


def scheme(mode: str, acts: str) -> dict:
    """What the manifest records about a quantized model."""
    import onnxruntime
    return {"mode": mode, "op": "com.microsoft.MatMulNBits", "bits": int(mode[3:]), "block_size": BLOCK_SIZE,
            "symmetric": SYMMETRIC, "accuracy_level": ACCURACY_LEVEL[acts],
            "activations": acts, "weights": "every MatMul with a constant "
            "weight (attention, MLP; the LM head unless tied to the embedding); embeddings and norms stay fp32",
            "quantizer": f"onnxruntime.quantization.MatMulNBitsQuantizer (onnxruntime {onnxruntime.__version__})"}


def quantize_onnx(src: Path, dst: Path, mode: str, acts: str, gguf: Path | None = None) -> dict:
    """Write `src` (an fp32 step graph of the target or a draft) as a weight-only int4/int8 graph at
    `dst` (external data if large), or with the blocks of the GGUF it came from (`gguf`); returns the
    manifest record: the scheme and the MatMul count."""
    import onnx
    from ..export.onnx_export import EXTERNAL_DATA_MIN_BYTES, remove_graph, save_graph

    if mode not in ("int4", "int8", "gguf"):
        raise ValueError(f"quantize mode {mode!r} is not int4, int8 or gguf")
    t0 = time.perf_counter()
    model = onnx.load(str(src))                     # with its external weights
    if mode == "gguf":
        return _gguf(model, src, dst, acts, gguf, t0)
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    before = sum(n.op_type == "MatMul" for n in model.graph.node)
    q = MatMulNBitsQuantizer(model, bits=int(mode[3:]), block_size=BLOCK_SIZE, is_symmetric=SYMMETRIC,
                             accuracy_level=ACCURACY_LEVEL[acts])
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)   # one INFO line per MatMul
    q.process()
    out = q.model.model
    nbits = sum(n.op_type == "MatMulNBits" for n in out.graph.node)
    if nbits == 0:
        raise RuntimeError(f"{src}: the quantizer found no MatMul with a constant weight to quantize")
    remove_graph(dst)
    save_graph(out, dst, external=sum(len(t.raw_data) for t in out.graph.initializer) > EXTERNAL_DATA_MIN_BYTES)
    log.info("quantized %s to %s: %d of %d MatMuls in %.1fs", src, mode, nbits, before, time.perf_counter() - t0)
    return {**scheme(mode, acts), "matmuls_quantized": nbits, "matmuls_total": before}


def _gguf(model, src: Path, dst: Path, acts: str, gguf: Path | None, t0: float) -> dict:
    """`quantize: gguf`: the GGUF's own blocks, exactly (gguf_blocks.py)."""
    import onnxruntime

    from ..export.onnx_export import EXTERNAL_DATA_MIN_BYTES, remove_graph, save_graph
    from .gguf_blocks import replace_matmuls

    if gguf is None or gguf.suffix != ".gguf":
        raise ValueError(f"quantize: gguf takes the blocks of a .gguf source; {gguf} is not one")
    counts = replace_matmuls(model, gguf, ACCURACY_LEVEL[acts])
    if counts["matmuls_quantized"] == 0:
        raise RuntimeError(f"{src}: no MatMul weight of the graph is a quantized tensor of {gguf}")
    remove_graph(dst)
    save_graph(model, dst, external=sum(len(t.raw_data) for t in model.graph.initializer) > EXTERNAL_DATA_MIN_BYTES)
    log.info("%s: %d of %d MatMuls take the GGUF's blocks in %.1fs", src, counts["matmuls_quantized"],
             counts["matmuls_total"], time.perf_counter() - t0)
    return {"mode": "gguf", "op": "com.microsoft.MatMulNBits", "bits": 4, "block_size": "the GGUF's (16 or 32)",
            "symmetric": False, "accuracy_level": ACCURACY_LEVEL[acts], "activations": acts,
            "weights": "the GGUF's block codes, scales and mins: 4-bit terms per nibble of the codes, the mins as "
                       "block sums times offsets; the engine's weights equal gguf.quants.dequantize bit for bit",
            "quantizer": f"trtspec.engines.gguf_blocks (onnxruntime {onnxruntime.__version__})", **counts}


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
