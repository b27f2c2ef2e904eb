"""The GGUF's own quantized blocks as ONNX Runtime MatMulNBits weights, exactly (`quantize: gguf`).

Every block type a GGUF mixes in stores, per block of 16 or 32 weights along K, small integer codes
q, a scale s and (K-quants, Q4_1/Q5_1) an offset c:  w = s * q + c,  with s * q exact in fp32 (at
most 11 + 8 + 6 significant bits) and one rounding for "+ c"; that is what `gguf.quants.dequantize`
computes. MatMulNBits computes (q - z) * s with 4-bit codes and integer zero points z. So:

- codes wider than 4 bits (Q5_*, Q6_K, Q8_0) are one 8-bit MatMulNBits term with int8 activations
  (accuracy level 4); with fp32 activations, where 8-bit weights take a slow kernel, they are split
  into nibbles, q - z = (lo - z_lo) + 16 (hi - z_hi): one 4-bit MatMulNBits per nibble, the high one
  with scale 16 s (exact), their outputs added;
- the offset c becomes a second, small product: the block sums of the activations (Reshape +
  ReduceSum) times the [K / block, N] matrix of offsets, added last.

Weights of one input with the same block type (q/k/v, gate/up) are joined along N into one product
and split after (`joined_matmul_nodes`): every output column is its own dot product, so each weight's
columns are the same bit for bit, from fewer, larger kernel calls.

With a one-hot activation row this graph returns s * q + c rounded once, i.e. the GGUF's weight bit
for bit (tests/e2e/test_gguf_blocks.py probes the kernels with an identity matrix; `python -m
trtspec.engines.gguf_blocks GRAPH FILE.gguf` does it for a built graph, every tensor). Float zero
points, MatMulNBits' own way to carry an offset, run 75x slower on this CPU (23 ms against 0.3 ms for
a one-row 1536 x 8960 product), and 8-bit codes with fp32 activations take another slow path, hence
nibbles there. MatMuls whose weight is F32/F16/BF16 or another block type stay fp32 (exact).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PREFIX = "gguf/"          # node and initializer names of a replaced MatMul: gguf/<tensor>/...


@dataclass
class Blocks:
    """w[n, k] = scale[n, k // block] * codes[n, k] + offset[n, k // block] (offset may be None)."""
    codes: np.ndarray            # int16 [N, K], zero point already subtracted
    scale: np.ndarray            # float32 [N, K // block]
    offset: np.ndarray | None    # float32 [N, K // block]
    block: int
    low: int                     # the smallest code the type can store (-z)
    bits: int                    # codes - low fit in this many bits

    def dequantize(self) -> np.ndarray:
        s = np.repeat(self.scale, self.block, axis=1)
        w = s * self.codes.astype(np.float32)
        return w + np.repeat(self.offset, self.block, axis=1) if self.offset is not None else w

    def rows(self, perm: np.ndarray) -> Blocks:
        return Blocks(self.codes[perm], self.scale[perm], None if self.offset is None else self.offset[perm],
                      self.block, self.low, self.bits)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)[:, 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, m] bytes -> [n, 2m]: the low nibbles, then the high ones (every GGUF 4-bit layout)."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _legacy(blocks: np.ndarray, has_min: bool, five: bool, eight: bool):
    at = 2
    d = _f16(blocks[:, 0:2])
    m = None
    if has_min:
        m, at = _f16(blocks[:, 2:4]), 4
    if eight:
        return blocks[:, at:at + 32].view(np.int8).astype(np.int16), d, m
    hbits = None
    if five:
        hbits = (np.ascontiguousarray(blocks[:, at:at + 4]).view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
        at += 4
    q = _nibbles(blocks[:, at:at + 16]).astype(np.int16)
    if five:
        q |= hbits.astype(np.int16) << 4
    return q, d, m


def _k_scales(blocks: np.ndarray):
    from gguf.quants import Q4_K
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))


def decode(raw: np.ndarray, qtype, shape: tuple[int, int]) -> Blocks | None:
    """The blocks of one GGUF tensor (raw bytes [N, row bytes], shape (N, K)), or None for a type we
    keep dense."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as Q

    if qtype not in _layout():
        return None
    n, k = shape
    per, size = GGML_QUANT_SIZES[qtype]
    b = np.ascontiguousarray(raw).reshape(n * (k // per), size)
    block, low, bits = _layout()[qtype]
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        q, d, m = _legacy(b, qtype in (Q.Q4_1, Q.Q5_1), qtype in (Q.Q5_0, Q.Q5_1), qtype == Q.Q8_0)
        scale, offset = d[:, None], (None if m is None else m[:, None])
        q = q + low if qtype in (Q.Q4_0, Q.Q5_0) else q
    elif qtype in (Q.Q4_K, Q.Q5_K):
        scale, offset = _k_scales(b)
        qs = b[:, 16:144] if qtype == Q.Q4_K else b[:, 48:176]
        q = np.concatenate([_nibbles(c) for c in np.split(qs, 4, axis=1)], axis=1).astype(np.int16)
        if qtype == Q.Q5_K:
            qh = b[:, 16:48]
            q |= np.concatenate([((qh >> i) & 1).astype(np.int16) << 4 for i in range(8)], axis=1)
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d
        ql, qh = b[:, 0:128], b[:, 128:192]
        lo = np.concatenate([_nibbles(c) for c in np.split(ql, 2, axis=1)], axis=1)
        hi = np.concatenate([(h >> s) & 3 for h in np.split(qh, 2, axis=1) for s in (0, 2, 4, 6)], axis=1)
        q = (lo | (hi << 4)).astype(np.int16) + low
        scale, offset = _f16(b[:, 208:210])[:, None] * b[:, 192:208].view(np.int8).astype(np.float32), None
    nb = k // block
    return Blocks(q.reshape(n, k), scale.reshape(n, nb).astype(np.float32),
                  None if offset is None else offset.reshape(n, nb).astype(np.float32), block, low, bits)


@functools.lru_cache(maxsize=1)
def _layout() -> dict:
    """(block, lowest code, code bits) per block type; gguf is imported on first use only."""
    from gguf import GGMLQuantizationType as Q
    return {Q.Q4_0: (32, -8, 4), Q.Q4_1: (32, 0, 4), Q.Q5_0: (32, -16, 5), Q.Q5_1: (32, 0, 5),
            Q.Q8_0: (32, -128, 8), Q.Q4_K: (32, 0, 4), Q.Q5_K: (32, 0, 5), Q.Q6_K: (16, -32, 6)}


# ---- ONNX ------------------------------------------------------------------------------------------

def _pack4(v: np.ndarray) -> np.ndarray:
    """[N, M] values 0..15 -> [N, ceil(M / 2)] bytes, element 2i in the low nibble."""
    if v.shape[1] % 2:
        v = np.pad(v, ((0, 0), (0, 1)))
    return (v[:, 0::2] | (v[:, 1::2] << 4)).astype(np.uint8)


def term_bits(bl: Blocks, accuracy_level: int) -> int:
    """4 (one MatMulNBits term per nibble of the codes) or 8 (one term): 8-bit weights take a fast
    kernel with int8 activations (level 4: a Q6_K 1536 x 151936 LM head 7.1 ms a token against 14.3
    for two nibble terms) and a slow one with fp32 activations (level 1: 29 ms against 0.85 for a
    1536 x 8960 weight), where nibbles stay. Codes of 4 bits stay one 4-bit term."""
    return 8 if accuracy_level == 4 and bl.bits > 4 else 4


def terms(bl: Blocks, bits: int = 4) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """MatMulNBits (B, scales, zero points) of `bits`-bit terms: the codes whole (8), or one per
    nibble of the codes, low nibble first (4)."""
    n, k = bl.codes.shape
    nb = k // bl.block
    u = (bl.codes - np.int16(bl.low)).astype(np.uint8)      # 0 .. 2^bits - 1 (int16: no wider copy)
    z = -bl.low
    if bits == 8:                      # one byte per code and per block's zero point
        return [(u.reshape(n, nb, bl.block), bl.scale.astype(np.float32), np.full(n * nb, z, dtype=np.uint8))]
    out = []
    for i in range((bl.bits + 3) // 4):
        part = (u >> (4 * i)) & 15
        b = _pack4(part).reshape(n, nb, bl.block // 2)
        zp = _pack4(np.full((n, nb), (z >> (4 * i)) & 15, dtype=np.uint8)).reshape(-1)
        out.append((b, (bl.scale * np.float32(16 ** i)).astype(np.float32), zp))
    return out


def matmul_nodes(name: str, x: str, y: str, bl: Blocks, accuracy_level: int):
    """Nodes and initializers computing y = x @ w.T for the GGUF weight w [N, K] held by `bl`."""
    from onnx import helper, numpy_helper

    n, k = bl.codes.shape
    p = f"{PREFIX}{name}/"
    nodes, inits, outs = [], [], []
    bits = term_bits(bl, accuracy_level)
    for i, (b, s, zp) in enumerate(terms(bl, bits)):
        names = [f"{p}q{i}", f"{p}scale{i}", f"{p}zero{i}"]
        inits += [numpy_helper.from_array(a, nm) for a, nm in zip((b, s, zp), names)]
        outs.append(f"{p}term{i}")
        nodes.append(helper.make_node("MatMulNBits", [x] + names, [outs[-1]], name=f"{p}term{i}",
                                      domain="com.microsoft", K=k, N=n, bits=bits, block_size=bl.block,
                                      accuracy_level=accuracy_level))
    acc = outs[0]
    for i in range(1, len(outs)):
        nodes.append(helper.make_node("Add", [acc, outs[i]], [f"{p}sum{i}"], name=f"{p}sum{i}"))
        acc = f"{p}sum{i}"
    if bl.offset is not None:
        nb = k // bl.block
        inits += [numpy_helper.from_array(np.array([0, 0, nb, bl.block], dtype=np.int64), f"{p}blocks"),
                  numpy_helper.from_array(np.array([-1], dtype=np.int64), f"{p}last"),
                  numpy_helper.from_array(np.ascontiguousarray(bl.offset.T), f"{p}offset")]
        nodes += [helper.make_node("Reshape", [x, f"{p}blocks"], [f"{p}xb"], name=f"{p}xb"),
                  helper.make_node("ReduceSum", [f"{p}xb", f"{p}last"], [f"{p}xsum"], keepdims=0,
                                   name=f"{p}xsum"),
                  helper.make_node("MatMul", [f"{p}xsum", f"{p}offset"], [f"{p}min"], name=f"{p}min"),
                  helper.make_node("Add", [acc, f"{p}min"], [f"{p}out"], name=f"{p}out")]
    nodes[-1].output[0] = y          # the replaced MatMul's output
    return nodes, inits


def gather_nodes(name: str, ids: str, y: str, bl: Blocks, lead: tuple[int, ...] | None = None, ids_rank: int = 2):
    """Nodes and initializers computing y = w[ids] from the blocks of w as they are: an embedding
    w [V, K] (`lead` (V,), ids [B, T]), or stacked experts w [E, N, K] (`lead` (E, N); `bl` holds their
    E * N rows) gathered by the rows' chosen experts (ids [B * T * k], `ids_rank` 1). ONNX Runtime's GatherBlockQuantized on the codes ((q - z) * s,
    exact in fp32), plus the gathered offsets where the type has them (one rounding, as gguf's), so
    the rows are the GGUF's weights bit for bit, at 4 or 8 bits a code instead of 32."""
    from onnx import helper, numpy_helper

    rows, k = bl.codes.shape
    lead = tuple(lead or (rows,))
    nb, p = k // bl.block, f"{PREFIX}{name}/"
    bits = 4 if bl.bits <= 4 else 8
    u = (bl.codes - np.int16(bl.low)).astype(np.uint8)
    z = -bl.low
    data = _pack4(u) if bits == 4 else u
    zero = _pack4(np.full((rows, nb), z, dtype=np.uint8)) if bits == 4 else np.full((rows, nb), z, dtype=np.uint8)
    inits = [numpy_helper.from_array(data.reshape(*lead, -1), f"{p}codes"),
             numpy_helper.from_array(bl.scale.reshape(*lead, nb), f"{p}scale"),
             numpy_helper.from_array(zero.reshape(*lead, -1), f"{p}zero")]
    nodes = [helper.make_node("GatherBlockQuantized", [f"{p}codes", ids, f"{p}scale", f"{p}zero"], [f"{p}rows"],
                              domain="com.microsoft", gather_axis=0, quantize_axis=len(lead), block_size=bl.block,
                              bits=bits, name=f"{p}gather")]
    if bl.offset is not None:       # y [*ids, *lead[1:], K]: those dims copied by Reshape's zeros, K split
        keep = [0] * (ids_rank + len(lead) - 1)
        inits += [numpy_helper.from_array(bl.offset.reshape(*lead, nb), f"{p}offset"),
                  numpy_helper.from_array(np.array(keep + [nb, bl.block], dtype=np.int64), f"{p}blocks"),
                  numpy_helper.from_array(np.array(keep + [nb, 1], dtype=np.int64), f"{p}one"),
                  numpy_helper.from_array(np.array(keep + [k], dtype=np.int64), f"{p}flat")]
        nodes += [helper.make_node("Gather", [f"{p}offset", ids], [f"{p}off"], axis=0, name=f"{p}off"),
                  helper.make_node("Reshape", [f"{p}rows", f"{p}blocks"], [f"{p}rb"], name=f"{p}rb"),
                  helper.make_node("Reshape", [f"{p}off", f"{p}one"], [f"{p}ob"], name=f"{p}ob"),
                  helper.make_node("Add", [f"{p}rb", f"{p}ob"], [f"{p}sum"], name=f"{p}sum"),
                  helper.make_node("Reshape", [f"{p}sum", f"{p}flat"], [f"{p}out"], name=f"{p}out")]
    nodes[-1].output[0] = y
    return nodes, inits


def joinable(a: Blocks, b: Blocks) -> bool:
    """Whether two weights of one input can be one product: the same block layout along K."""
    return (a.codes.shape[1], a.block, a.low, a.bits, a.offset is None) == \
        (b.codes.shape[1], b.block, b.low, b.bits, b.offset is None)


def join(parts: list[Blocks]) -> Blocks:
    """The weights stacked along N: one product computes them all. Every output column of
    MatMulNBits (and of the offsets' product) is its own dot product over K, so each column of the
    joined product is the column of its own product, bit for bit (tests/e2e/test_gguf_blocks.py)."""
    first = parts[0]
    offset = None if first.offset is None else np.concatenate([p.offset for p in parts])
    return Blocks(np.concatenate([p.codes for p in parts]), np.concatenate([p.scale for p in parts]), offset,
                  first.block, first.low, first.bits)


def joined_matmul_nodes(names: list[str], x: str, ys: list[str], parts: list[Blocks], accuracy_level: int):
    """matmul_nodes for weights that read the same input (q/k/v, gate/up): one product over the
    joined weights, split into each weight's output. Node names: gguf/<tensor>+<tensor>.../..."""
    from onnx import helper, numpy_helper

    if not all(joinable(parts[0], b) for b in parts):
        raise ValueError(f"{names}: weights of different block layouts cannot be one product")
    name = "+".join(n.split("/", 1)[0] for n in names) + "/" + names[0].split("/", 1)[1]
    p = f"{PREFIX}{name}/"
    nodes, inits = matmul_nodes(name, x, f"{p}joined", join(parts), accuracy_level)
    sizes = np.array([b.codes.shape[0] for b in parts], dtype=np.int64)
    inits.append(numpy_helper.from_array(sizes, f"{p}sizes"))
    nodes.append(helper.make_node("Split", [f"{p}joined", f"{p}sizes"], list(ys), axis=-1, name=f"{p}split"))
    return nodes, inits


def _row_order(spec, tensor: str, rows: int) -> np.ndarray:
    """A GGUF tensor's rows in the model's order: llama.cpp's converter permutes llama's q/k rows
    (gguf_loader.unpermute_rope undoes it, as the loader does); every other tensor keeps its order."""
    import torch

    from ..export.gguf_loader import unpermute_rope
    heads = spec.num_heads if ".attn_q." in tensor else spec.num_kv_heads if ".attn_k." in tensor else 0
    if spec.extra["gguf_arch"] != "llama" or not heads:
        return np.arange(rows)
    return unpermute_rope(torch.arange(rows), heads).numpy()


# ---- verification: the engine's weights, probed through its kernels ----------------------------------

def probe(model_path: Path, gguf_path: Path) -> dict[str, bool]:
    """For each product of GGUF tensors in the graph at `model_path` (one tensor, or several joined:
    `gguf/<tensor>+<tensor>/...`): do the graph's MatMulNBits nodes (run by ONNX Runtime at accuracy
    level 1 on an identity matrix, the terms added and the offsets expanded as the graph does) give
    `gguf.quants.dequantize`'s weights, stacked, bit for bit?"""
    import onnx
    import onnxruntime as ort
    from onnx import helper, numpy_helper

    from ..export.gguf_loader import GGUFFile, spec_from_gguf

    model = onnx.load(str(model_path))
    inits = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list] = {}
    for node in model.graph.node:
        if node.name.startswith(PREFIX) and node.op_type == "MatMulNBits":
            groups.setdefault(node.name.rsplit("/", 1)[0], []).append(node)
    gf = GGUFFile(gguf_path)
    spec = spec_from_gguf(gf)
    tensors = {t.name: t for t in gf.tensors}
    out = {}
    for node in model.graph.node:         # embeddings and experts gathered from their blocks: every row
        if node.name.startswith(PREFIX) and node.op_type == "GatherBlockQuantized":
            group = node.name.rsplit("/", 1)[0]
            t = tensors[group[len(PREFIX):].split("/", 1)[0].partition("[")[0]]
            rows = np.arange(t.shape[0], dtype=np.int64)
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            weight = [node.input[0], node.input[2], node.input[3]]
            g = helper.make_graph(
                [helper.make_node("GatherBlockQuantized", [weight[0], "ids", *weight[1:]], ["Y"], domain="com.microsoft",
                                  **attrs)], "probe", [helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, [None])],
                [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, None)], [inits[i] for i in weight])
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
            y = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": rows})[0]
            if (off := inits.get(f"{group}/offset")) is not None:       # [V, K // block] or [E, N, K // block]
                o = numpy_helper.to_array(off)
                y = (y.reshape(*o.shape, -1) + o[..., None]).reshape(y.shape)
            want = _weight(gf, spec, tensors, group[len(PREFIX):].split("/", 1)[0])
            out[group] = y.shape == want.shape and np.array_equal(_bits(y), _bits(want))
    for group, nodes in groups.items():
        tname = group[len(PREFIX):].split("/", 1)[0]
        total = None
        for node in sorted(nodes, key=lambda nd: nd.name):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            attrs["accuracy_level"] = 1
            k = attrs["K"]
            # B, scales, zero points: the weight. ORT's optimizer may have fused the model's bias
            # (q/k/v) into a lone term as input 5, which is not the weight's and is left out.
            weight = list(node.input[1:4])
            g = helper.make_graph(
                [helper.make_node("MatMulNBits", ["A"] + weight, ["Y"], domain="com.microsoft", **attrs)], "probe",
                [helper.make_tensor_value_info("A", onnx.TensorProto.FLOAT, [k, k])],
                [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, [k, attrs["N"]])],
                [inits[i] for i in weight])
            m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
            sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
            y = sess.run(None, {"A": np.eye(k, dtype=np.float32)})[0].T       # [N, K]
            total = y if total is None else total + y        # exact: every term and sum is representable
        off = inits.get(f"{group}/offset")
        if off is not None:
            o = numpy_helper.to_array(off).T
            total = total + np.repeat(o, k // o.shape[1], axis=1)
        want = np.concatenate([_weight(gf, spec, tensors, n) for n in tname.split("+")])
        out[group] = total.shape == want.shape and np.array_equal(_bits(total), _bits(want))
    return out


def _weight(gf, spec, tensors: dict, label: str) -> np.ndarray:
    """The dequantized weight a product's name stands for: a GGUF tensor in the model's row order, or
    its rows [a:b] (a piece of a joined tensor: Phi-3's q/k/v and gate/up)."""
    from ..export.gguf_loader import _dequantize
    name, _, rows = label.partition("[")
    t = tensors[name]
    w = _dequantize(gf, t)[_row_order(spec, t.name, t.shape[0])]
    if rows:
        a, b = (int(v) for v in rows.rstrip("]").split(":"))
        w = w[a:b]
    return w


def _bits(a: np.ndarray) -> np.ndarray:
    """fp32 bit patterns, -0 read as +0 (gguf's -0 for a zero code under a negative scale is the
    kernel's +0: the same weight in every product and sum)."""
    return (a + np.float32(0)).view(np.uint32)


def main(argv: list[str] | None = None) -> int:
    """python -m trtspec.engines.gguf_blocks MODEL.onnx FILE.gguf: probe every replaced weight."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m trtspec.engines.gguf_blocks MODEL.onnx FILE.gguf  (a `quantize: gguf` graph "
              "and the GGUF it was built from)", file=sys.stderr)
        return 2
    res = probe(Path(argv[0]), Path(argv[1]))
    bad = [g for g, ok in res.items() if not ok]
    tensors = sum(len(g[len(PREFIX):].split("/", 1)[0].split("+")) for g in res)
    bad_tensors = sum(len(g[len(PREFIX):].split("/", 1)[0].split("+")) for g in bad)
    print(f"{tensors} GGUF weights ({len(res)} products) probed through ONNX Runtime's kernels: "
          f"{tensors - bad_tensors} bit-exact, {bad_tensors} not" + (": " + ", ".join(bad[:5]) if bad else ""))
    return 1 if bad or not res else 0


if __name__ == "__main__":
    sys.exit(main())
