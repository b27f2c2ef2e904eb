"""One MatMulNBits shape at several bit widths and block sizes, streamed from memory: 28 copies of
random weights in one graph (one per layer, as a model reads them), one input row, 2 threads, level 4
(int8 activations), no spinning. `python lab/bench/kernels/block_sizes.py 1536 17920 4,32,1 4,128,0`
(each BITS,BLOCK,ZERO_POINTS: 1 = an explicit uint8 zero point per block, 0 = the kernel's default)."""
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

LAYERS = 28


def graph(k: int, n: int, bits: int, block: int, zero_points: bool) -> bytes:
    rng = np.random.default_rng(0)
    blocks, nodes, inits = k // block, [], []
    for i in range(LAYERS):
        codes = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
        inits += [numpy_helper.from_array(codes, f"b{i}"),
                  numpy_helper.from_array((rng.random(n * blocks) * 0.01).astype(np.float32), f"s{i}")]
        inputs = ["x", f"b{i}", f"s{i}"]
        if zero_points:
            size = n * ((blocks + 1) // 2) if bits == 4 else n * blocks
            inits.append(numpy_helper.from_array(np.zeros(size, dtype=np.uint8), f"z{i}"))
            inputs.append(f"z{i}")
        nodes.append(helper.make_node("MatMulNBits", inputs, [f"y{i}"], domain="com.microsoft", K=k, N=n,
                                      bits=bits, block_size=block, accuracy_level=4))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, n]) for i in range(LAYERS)],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def main() -> None:
    k, n = int(sys.argv[1]), int(sys.argv[2])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    x = np.random.default_rng(1).standard_normal((1, k), dtype=np.float32)
    for spec in sys.argv[3:]:
        bits, block, zp = map(int, spec.split(","))
        s = ort.InferenceSession(graph(k, n, bits, block, bool(zp)), so, providers=["CPUExecutionProvider"])
        took = []
        for r in range(18):
            t = time.perf_counter()
            s.run(None, {"x": x})
            if r >= 3:
                took.append((time.perf_counter() - t) / LAYERS)
        ms = float(np.median(took)) * 1e3
        size = k * n * (bits / 8 + 4 / block + (bits / 8 / block if zp else 0))
        print(f"bits {bits}, block {block}, zero points {'yes' if zp else 'no'}: {ms:.3f} ms a product, "
              f"{k * n / ms / 1e6:.1f} Gweights/s, {size / ms / 1e6:.1f} GB/s")
        del s


if __name__ == "__main__":
    main()
