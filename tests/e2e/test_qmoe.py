"""A mixture's experts on ONNX Runtime's QMoE (engines/qmoe.py), as `quantize: int4` builds
write them: the weights' layout and the routing are the model's (the module on the same quantized
weights, dequantized, gives the same rows to fp32 accuracy, with and without renormalized top-k),
and one row per call makes every row of a 16-row forward equal to the same row alone, bit for bit,
where one call over all rows would not (the check can fail)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from trtspec.engines.qmoe import experts_nodes
from trtspec.export.model import MoE
from trtspec.export.spec import ModelSpec

ort = pytest.importorskip("onnxruntime")


def spec(renorm: bool) -> ModelSpec:
    return ModelSpec(arch="qwen3_moe", vocab_size=16, hidden_size=128, intermediate_size=64, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=128, num_experts=32, experts_per_token=4,
                     moe_intermediate_size=64, norm_topk_prob=renorm)


class Source:
    """The module's experts under the checkpoint's names, as engines/weights.py serves them."""

    def __init__(self, moe: MoE):
        self.moe = moe

    def get(self, key, dtype):
        return getattr(self.moe.experts, key.rsplit(".", 1)[1]).detach().to(dtype)


def session(s: ModelSpec, moe: MoE, level: int, rows_per_call: bool = True):
    """A graph of y = experts(x, router logits) for [T, H] rows: engines/qmoe.py's nodes, or (for the
    control) one QMoE call over all the rows, on the same initializers."""
    node = helper.make_node("Experts", ["x", "logits"], ["y"], domain="trtspec", layer=0)
    nodes, inits = experts_nodes(node, Source(moe), s, level)
    if not rows_per_call:
        scan = next(n for n in nodes if n.op_type == "Scan")
        qmoe = next(n for n in scan.attribute[0].g.node if n.op_type == "QMoE")
        qmoe.input[0], qmoe.input[1], qmoe.output[0] = "x", "logits", "y"
        nodes = [qmoe]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, s.hidden_size]),
                                       helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, s.num_experts])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]), inits


def dequantized(inits, name: str) -> torch.Tensor:
    """[E, N, K] weights from QMoE's 4-bit codes, scales and zero points (low nibble first)."""
    a = {t.name: onnx.numpy_helper.to_array(t) for t in inits}
    q, s, z = a[name], a[name + "_scales"], a[name + "_zero_points"]
    q = np.stack([q & 15, q >> 4], -1).reshape(*q.shape[:2], -1)
    z = np.stack([z & 15, z >> 4], -1).reshape(*z.shape[:2], -1)[..., :s.shape[-1]]
    e, n, k = q.shape
    w = (q.reshape(e, n, s.shape[-1], -1).astype(np.float32) - z[..., None]) * s[..., None]
    return torch.from_numpy(w.reshape(e, n, k))


def model(s: ModelSpec, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(s).eval().requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0, p.shape[-1] ** -0.5)
    moe.gate.weight.mul_(8.0)          # peaked routing: no near-ties between the two top-k's
    return moe


@pytest.mark.parametrize("renorm", [True, False])
def test_qmoe_computes_the_module_on_its_quantized_weights(renorm):
    s = spec(renorm)
    moe = model(s)
    sess, inits = session(s, moe, level=1)             # fp32 activations: only the weights differ
    x = torch.randn(16, s.hidden_size)
    got = sess.run(None, {"x": x.numpy(), "logits": moe.gate(x).numpy()})[0]
    fc1 = dequantized(inits, "experts/0/fc1")
    moe.experts.gate_proj.copy_(fc1[:, 0::2])                # gate and up interleaved row by row
    moe.experts.up_proj.copy_(fc1[:, 1::2])
    moe.experts.down_proj.copy_(dequantized(inits, "experts/0/fc2"))
    want = moe(x[None])[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_every_row_is_the_same_row_alone():
    s = spec(True)
    moe = model(s, seed=1)
    x = torch.randn(16, s.hidden_size)
    feed = {"x": x.numpy(), "logits": moe.gate(x).numpy()}
    for rows_per_call, exact in ((True, True), (False, False)):
        sess, _ = session(s, moe, level=4, rows_per_call=rows_per_call)
        y = sess.run(None, feed)[0]
        alone = np.concatenate([sess.run(None, {k: v[i:i + 1] for k, v in feed.items()})[0] for i in range(16)])
        same = np.array_equal(alone.view(np.uint32), y.view(np.uint32))
        assert same == exact, (rows_per_call, [i for i in range(16) if not np.array_equal(alone[i], y[i])])
        assert np.array_equal(sess.run(None, feed)[0], y)           # and the same again


def test_widths_not_in_whole_blocks_are_refused_in_one_line():
    from trtspec.engines.manifest import EngineError
    s = spec(True)
    s.hidden_size = s.head_dim = 72                      # QMoE takes whole blocks of 32 along K
    node = helper.make_node("Experts", ["x", "logits"], ["y"], domain="trtspec", layer=0)
    with pytest.raises(EngineError, match=r"hidden size \(72\).*whole blocks of 32; build this model with"):
        experts_nodes(node, None, s, 4)
