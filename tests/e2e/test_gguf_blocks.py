"""`quantize: gguf`: the GGUF's own blocks in ONNX Runtime's MatMulNBits, exactly. Every block type
a GGUF mixes in, decoded and run through the kernels on an identity matrix, gives
`gguf.quants.dequantize`'s weights bit for bit; a tiny GGUF built with them gives the fp32 graph's
logits, and every strategy reproduces that folder's `ar`."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from trtspec.engines import gguf_blocks

gguf = pytest.importorskip("gguf")
ort = pytest.importorskip("onnxruntime")
Q = gguf.GGMLQuantizationType
LEGACY = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def random_blocks(qtype, rows: int, cols: int, rng) -> np.ndarray:
    """Well-formed blocks: gguf's own quantizer for the legacy types; random bits with finite fp16
    scales where the layout keeps them for the K-quants (gguf cannot quantize those)."""
    if qtype in LEGACY:
        return gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = rng.uniform(0.001, 0.01, size=(rows, cols // block, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        b[..., -2:] = scale[..., :2].reshape(rows, cols // block, 2)   # d trails the block
    else:
        b[..., 0:4] = scale.reshape(rows, cols // block, 4)             # d, dmin lead it
    return b.reshape(rows, -1)


def bits(a: np.ndarray) -> np.ndarray:
    """The fp32 bit patterns, with -0 read as +0 (gguf gives -0 for a zero code under a negative
    scale; the kernel +0: the same weight in every product and sum)."""
    return (a + np.float32(0)).view(np.uint32)


def run_nodes(nodes, inits, x: np.ndarray) -> np.ndarray:
    k = x.shape[-1]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, None, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def at_level(nodes, level: int):
    """The nodes with every MatMulNBits at `level` (as `probe` runs a graph's: level 1)."""
    out = []
    for nd in nodes:
        nd = onnx.NodeProto.FromString(nd.SerializeToString())
        for a in nd.attribute:
            if a.name == "accuracy_level":
                a.i = level
        out.append(nd)
    return out


@pytest.mark.parametrize("level", [1, 4])
@pytest.mark.parametrize("qtype", LEGACY + K_QUANTS, ids=lambda q: q.name)
def test_engine_weights_are_the_gguf_s_bit_for_bit(qtype, level):
    """Decoded blocks reproduce gguf.quants.dequantize, and so do ONNX Runtime's kernels running the
    emitted nodes on one-hot rows (at accuracy level 1, fp32 activations: what `probe` does):
    w = s * q + c rounded once, as gguf computes it. Nodes made for level 1 split codes wider than 4
    bits into nibble terms; for level 4 (int8 activations) they are one 8-bit term. At level 4 a
    product's rows do not depend on how many rows it carries (exact attention relies on it)."""
    rng = np.random.default_rng(int(qtype))
    n, k = 48, 512
    raw = random_blocks(qtype, n, k, rng)
    want = gguf.quants.dequantize(raw, qtype)
    bl = gguf_blocks.decode(raw, qtype, (n, k))
    assert bl is not None and np.array_equal(bl.dequantize().view(np.uint32), want.view(np.uint32))  # the decoder: even -0
    nodes, inits = gguf_blocks.matmul_nodes("w", "x", "y", bl, accuracy_level=level)
    nbits = [nd for nd in nodes if nd.op_type == "MatMulNBits"]
    wide = level == 4 and bl.bits > 4
    assert len(nbits) == (1 if wide else (bl.bits + 3) // 4)
    assert {helper.get_attribute_value(a) for nd in nbits for a in nd.attribute if a.name == "bits"} == {8 if wide else 4}
    got = run_nodes(at_level(nodes, 1), inits, np.eye(k, dtype=np.float32)[None])[0].T
    assert np.array_equal(bits(got), bits(want))
    # and an ordinary product: the fp32 product with the same weights, to fp32 accuracy (level 1)
    # or to int8 activations' (level 4), whose rows are the same alone as in a batch of 16, bit for bit
    x = rng.standard_normal((1, 16, k)).astype(np.float32)
    y = run_nodes(nodes, inits, x)[0]
    tol = 1e-4 if level == 1 else 3e-2
    np.testing.assert_allclose(y, x[0] @ want.T, rtol=tol, atol=tol * float(np.abs(x[0] @ want.T).max()))
    if level == 4:
        alone = np.concatenate([run_nodes(nodes, inits, x[:, i:i + 1])[0] for i in range(16)])
        assert np.array_equal(alone.view(np.uint32), y.view(np.uint32))
    # the same blocks as an embedding table: every gathered row is the file's row, bit for bit
    nodes, inits = gguf_blocks.gather_nodes("w", "x", "y", bl)
    ids = np.arange(n, dtype=np.int64)[None, ::-1].copy()
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.INT64, [None, None])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    rows = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": ids})[0]
    assert np.array_equal(bits(rows[0]), bits(want[ids[0]]))
    # and as 4 stacked experts of 12 rows each, gathered by a flat list of choices (a mixture's form)
    nodes, inits = gguf_blocks.gather_nodes("w", "x", "y", bl, lead=(4, 12), ids_rank=1)
    ids = np.array([3, 0, 2, 2, 1], dtype=np.int64)
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    rows = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": ids})[0]
    assert np.array_equal(bits(rows), bits(want.reshape(4, 12, k)[ids]))


def graph_steps_like_torch(model, graph, prompt: int = 9, capacity: int = 32) -> None:
    """A prefill of `prompt` random tokens, then one more: the ONNX graph at `graph` on ONNX Runtime
    gives the torch model's logits to fp32 accuracy (1e-4)."""
    import torch
    from test_onnx import assert_step_close, prefill

    from trtspec.engines.onnxruntime_engine import OrtEngine
    from trtspec.engines.torch_engine import TorchEngine
    engines = TorchEngine(model), OrtEngine(graph, model.spec, intra_op_threads=1)
    caches = [e.new_cache(capacity) for e in engines]
    gen = torch.Generator().manual_seed(2)
    for args in (prefill(gen, 0, prompt), prefill(gen, prompt, 1)):
        a, b = (e.step(c, *args) for e, c in zip(engines, caches))
        assert_step_close(b, a, 1e-4)
        for c in caches:
            c.advance(args[0].shape[0])
            c.commit(range(args[0].shape[0]))


def test_types_kept_dense_are_none():
    assert gguf_blocks.decode(np.zeros((2, 64), np.uint8), Q.F16, (2, 32)) is None


MIXED = {"attn_q": Q.Q4_K, "attn_k": Q.Q5_K, "attn_v": Q.Q6_K, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0,
         "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0}
Q4_K_M = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q4_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
          "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K, "token_embd": Q.Q4_K}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory):
    """A tiny GGUF whose projections use the block types of a Q4_K_M file and of older ones (llama:
    q/k rows permuted the way llama.cpp's converter writes them)."""
    return make_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", request.param, MIXED)


def make_tiny_gguf(path, arch: str, plan: dict, tie: bool = False):
    import torch
    from test_gguf import gguf_name, llama_cpp_permute, tiny_hf, write_gguf

    cfg, model = tiny_hf(arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tie)
    rng = np.random.default_rng(0)
    tensors, raw = {}, {}
    for k, v in model.state_dict().items():
        if tie and k == "lm_head.weight":              # tied: the file has no output.weight
            continue
        name, a = gguf_name(k), v.numpy()
        kind = name.split(".")[-2]
        qtype = Q.Q6_K if name == "output.weight" else plan.get(kind) if name.endswith(".weight") else None
        if name == "blk.1.ffn_down.weight":
            qtype = Q.Q5_1
        if qtype in K_QUANTS:
            a = random_blocks(qtype, *a.shape, rng)
        elif qtype is not None:
            if arch == "llama" and kind in ("attn_q", "attn_k"):
                a = llama_cpp_permute(a, 4, 4 if kind == "attn_q" else 2)
            a = gguf.quants.quantize(a, qtype)
        if qtype is not None:
            raw[name] = qtype
        tensors[name] = a
    write_gguf(path, arch, cfg, tensors, raw)
    torch.manual_seed(0)
    return path


def test_a_tiny_gguf_graph_takes_its_blocks_exactly(tiny_gguf, tmp_path):
    """Every projection and the LM head of the exported graph become MatMulNBits terms of the file's
    own blocks: probed through ONNX Runtime, each equals the file's weight bit for bit (llama's q/k
    in the un-permuted order the model uses), and the graph's logits are the fp32 model's."""
    import torch

    from trtspec.export.checkpoint import load_decoder
    from trtspec.export.onnx_export import optimize_for_ort
    from trtspec.engines.stream import build_graph
    from trtspec.engines.weights import open_weights

    model = load_decoder(tiny_gguf)
    rec = build_graph(open_weights(tiny_gguf), tmp_path / "q.onnx", torch.float32, quantize="gguf", accuracy_level=1)
    assert rec["matmuls_quantized"] == rec["matmuls_total"] == 2 * 7 + 1
    assert rec["block_types"] == {"Q4_K": 2, "Q5_K": 2, "Q6_K": 3, "Q8_0": 2, "Q4_0": 2, "Q4_1": 2, "Q5_0": 1,
                                  "Q5_1": 1}
    graph = onnx.load(str(tmp_path / "q.onnx"))
    weights = {i.name for i in graph.graph.initializer}
    assert not [n for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in weights
                and not n.name.startswith("gguf/")]
    res = gguf_blocks.probe(tmp_path / "q.onnx", tiny_gguf)
    assert len(res) == 15 and all(res.values()), res
    assert gguf_blocks.main([str(tmp_path / "q.onnx"), str(tiny_gguf)]) == 0
    # int8 activations: Q5_*/Q6_K/Q8_0 as one 8-bit term each, the same weights bit for bit
    build_graph(open_weights(tiny_gguf), tmp_path / "q8.onnx", torch.float32, quantize="gguf", accuracy_level=4)
    wide = [n for n in onnx.load(str(tmp_path / "q8.onnx")).graph.node if n.op_type == "MatMulNBits"
            and any(a.name == "bits" and a.i == 8 for a in n.attribute)]
    assert len(wide) == 2 + 3 + 2 + 1 + 1            # Q5_K, Q6_K, Q8_0, Q5_0, Q5_1: one term each
    # probed in the graph an engine folder holds: ORT's optimizer fuses qwen2's v bias into a lone term
    optimize_for_ort(tmp_path / "q8.onnx", tmp_path / "q8.ort.onnx")
    res = gguf_blocks.probe(tmp_path / "q8.ort.onnx", tiny_gguf)
    assert len(res) == 15 and all(res.values()), res

    graph_steps_like_torch(model, tmp_path / "q.onnx")


def test_the_probe_catches_a_changed_weight(tiny_gguf, tmp_path):
    """The probe can fail: one scale moved by one ulp in the built graph is reported."""
    import torch
    from onnx import numpy_helper

    from trtspec.engines.stream import build_graph
    from trtspec.engines.weights import open_weights

    build_graph(open_weights(tiny_gguf), tmp_path / "q.onnx", torch.float32, quantize="gguf", accuracy_level=1)
    graph = onnx.load(str(tmp_path / "q.onnx"))
    init = next(i for i in graph.graph.initializer if i.name.endswith("/scale0") and "attn_v" in i.name)
    a = numpy_helper.to_array(init).copy()
    a.flat[0] = np.nextafter(a.flat[0], np.float32(np.inf))
    init.CopyFrom(numpy_helper.from_array(a, init.name))
    onnx.save(graph, str(tmp_path / "bad.onnx"))
    res = gguf_blocks.probe(tmp_path / "bad.onnx", tiny_gguf)
    assert [g for g, ok in res.items() if not ok] == [g for g in res if "blk.0.attn_v" in g]
    assert gguf_blocks.main([str(tmp_path / "bad.onnx"), str(tiny_gguf)]) == 1


def test_a_build_refuses_blocks_that_decode_differently(tiny_gguf, tmp_path, monkeypatch):
    """If the decoded blocks ever stop being gguf's weights (a format change), the build stops with one
    error naming the tensor instead of writing a graph with other weights: one scale a ulp off is
    enough (checked slice by slice of rows, as the streaming build does)."""
    import torch

    from trtspec.engines.stream import build_graph
    from trtspec.engines.weights import open_weights

    real = gguf_blocks.decode

    def off_by_one_ulp(raw, qtype, shape):
        bl = real(raw, qtype, shape)
        if bl is not None and qtype == Q.Q6_K:
            bl.scale[0, 0] = np.nextafter(bl.scale[0, 0], np.float32(np.inf))
        return bl

    monkeypatch.setattr(gguf_blocks, "decode", off_by_one_ulp)
    with pytest.raises(RuntimeError, match=r"tensor \S+ \(Q6_K\) decodes differently from gguf.quants.dequantize"):
        build_graph(open_weights(tiny_gguf), tmp_path / "q.onnx", torch.float32, quantize="gguf", accuracy_level=1)
    assert not (tmp_path / "q.onnx").exists()          # nothing half-written left behind


@pytest.mark.parametrize("level", [1, 4])
def test_joined_products_give_each_weight_s_columns_bit_for_bit(level):
    """q/k/v (or gate/up) as one MatMulNBits over the joined weights, split after: each output is the
    output of its own product bit for bit, at one row and at 16 (every column is its own dot product,
    and the offsets' product too)."""
    from onnx import numpy_helper
    rng = np.random.default_rng(level)
    k, sizes = 512, (96, 32, 32)
    parts = [gguf_blocks.decode(random_blocks(Q.Q4_K, n, k, rng), Q.Q4_K, (n, k)) for n in sizes]
    assert all(gguf_blocks.joinable(parts[0], p) for p in parts)
    nodes, inits = gguf_blocks.joined_matmul_nodes([f"t{i}/mm" for i in range(3)], "x", ["y0", "y1", "y2"],
                                                   parts, level)
    assert sum(nd.op_type == "MatMulNBits" for nd in nodes) == 1
    nodes.append(helper.make_node("Concat", ["y0", "y1", "y2"], ["y"], axis=-1))
    for rows in (1, 16):
        x = rng.standard_normal((1, rows, k)).astype(np.float32)
        got = run_nodes(nodes, inits, x)
        alone = np.concatenate([run_nodes(*gguf_blocks.matmul_nodes(f"t{i}", "x", "y", p, level), x)
                                for i, p in enumerate(parts)], axis=-1)
        assert np.array_equal(bits(got), bits(alone))
    assert not gguf_blocks.joinable(parts[0], gguf_blocks.decode(random_blocks(Q.Q6_K, 32, k, rng), Q.Q6_K, (32, k)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_q4_k_m_graph_joins_q_k_v_and_gate_up(arch, tmp_path):
    """A Q4_K_M-like file: per layer q/k/v become one product and gate/up one, the probe still finds
    every weight equal to the file's (the joined ones split back into their tensors), and the graph
    gives the same logits bit for bit as the same weights product by product, at int8 activations."""
    import torch
    from test_onnx import prefill

    from trtspec.engines import stream
    from trtspec.engines.onnxruntime_engine import OrtEngine
    from trtspec.engines.stream import build_graph
    from trtspec.engines.weights import open_weights
    from trtspec.export.checkpoint import load_decoder

    path = make_tiny_gguf(tmp_path / f"{arch}.gguf", arch, Q4_K_M)
    rec = build_graph(open_weights(path), tmp_path / "j.onnx", torch.float32, quantize="gguf", accuracy_level=4)
    assert rec["matmuls_quantized"] == rec["matmuls_total"] == 2 * 7 + 1
    assert rec["joined_products"] == 2 * 2 and rec["embedding"] == "Q4_K"
    nodes = onnx.load(str(tmp_path / "j.onnx")).graph.node
    assert sum(n.op_type == "MatMulNBits" for n in nodes) == 2 * 4 + 1
    assert [n.op_type for n in nodes if "embedding" in n.output] == ["Reshape"]     # the gather's offsets added
    res = gguf_blocks.probe(tmp_path / "j.onnx", path)
    assert len(res) == 2 * 4 + 1 + 1 and all(res.values()), res          # the products and the embedding
    assert any("+" in g for g in res) and any("token_embd" in g for g in res)
    with pytest.MonkeyPatch.context() as mp:                           # the same graph, one product per weight
        mp.setattr(stream, "_groups", lambda matmuls, *a: [[n] for n in matmuls])
        build_graph(open_weights(path), tmp_path / "s.onnx", torch.float32, quantize="gguf", accuracy_level=4)
    spec = load_decoder(path).spec
    engines = [OrtEngine(tmp_path / f, spec, intra_op_threads=2) for f in ("j.onnx", "s.onnx")]
    caches = [e.new_cache(32) for e in engines]
    gen = torch.Generator().manual_seed(3)
    for args in (prefill(gen, 0, 9), prefill(gen, 9, 1)):
        a, b = (e.step(c, *args) for e, c in zip(engines, caches))
        assert torch.equal(a, b)
        for c in caches:
            c.advance(args[0].shape[0])
            c.commit(range(args[0].shape[0]))


def test_a_mixture_s_quantized_experts_are_gathered_from_their_blocks(tmp_path):
    """A Qwen3-MoE GGUF whose stacked experts are stored in blocks (gate Q4_K, up Q6_K, down Q8_0, as
    quantized files mix them): `quantize: gguf` gathers each row's experts from the file's blocks
    (GatherBlockQuantized, Q4_K's offsets added after), the probe finds every expert equal to
    gguf.quants.dequantize bit for bit, and the graph's logits are the dequantized model's."""
    import torch
    import transformers
    from test_gguf import gguf_name, write_gguf

    from trtspec.engines.stream import build_graph
    from trtspec.engines.weights import open_weights
    from trtspec.export.checkpoint import load_decoder

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=256, intermediate_size=256, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=64, num_hidden_layers=2, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    plan = {"gate": Q.Q4_K, "up": Q.Q6_K, "down": Q.Q8_0}
    tensors, raw = {}, {}
    for k, v in model.state_dict().items():
        layer = k.split(".")[2] if k.startswith("model.layers.") else None
        if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):   # transformers 5: gate and up stacked
            parts = zip(("gate", "up"), v.chunk(2, 1)) if "gate_up" in k else [("down", v)]
            for part, w in parts:
                e, n, kk = w.shape
                name, q = f"blk.{layer}.ffn_{part}_exps.weight", plan[part]
                b = random_blocks(q, e * n, kk, rng) if q in K_QUANTS else \
                    gguf.quants.quantize(w.reshape(e * n, kk).contiguous().numpy(), q)
                tensors[name], raw[name] = b.reshape(e, n, -1), q
            continue
        tensors[f"blk.{layer}.ffn_gate_inp.weight" if k.endswith("mlp.gate.weight") else gguf_name(k)] = v.numpy()
    cfg.rope_parameters = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    path = tmp_path / "moe.gguf"
    write_gguf(path, "qwen3moe", cfg, tensors, raw, more=lambda w: (
        w.add_expert_count(4), w.add_expert_used_count(2), w.add_expert_feed_forward_length(64), w.add_key_length(64)))

    rec = build_graph(open_weights(path), tmp_path / "q.onnx", torch.float32, quantize="gguf", accuracy_level=1)
    assert rec["experts_quantized"] == rec["experts_total"] == 2 * 3
    assert rec["experts"] == "Q4_K, Q6_K, Q8_0: gathered from its blocks"
    nodes = onnx.load(str(tmp_path / "q.onnx")).graph.node
    assert sum(n.op_type == "GatherBlockQuantized" for n in nodes) == 2 * 3
    res = gguf_blocks.probe(tmp_path / "q.onnx", path)
    experts = [g for g in res if "_exps" in g]
    assert len(experts) == 2 * 3 and all(res.values()), res
    model = load_decoder(path)
    graph_steps_like_torch(model, tmp_path / "q.onnx")


@pytest.mark.parametrize("embd", [Q.Q8_0, Q.Q6_K], ids=lambda q: q.name)
def test_a_tied_lm_head_runs_from_the_embedding_s_blocks(embd, tmp_path):
    """A GGUF whose LM head is its embedding (no output.weight, as Qwen2.5-1.5B's and SmolLM2's):
    `quantize: gguf` runs the head from the embedding's own blocks, the blocks the embedding is
    gathered from (no dense fp32 table left in the graph); the probe finds the head equal to the
    file's embedding bit for bit, and the logits are the dequantized model's."""
    import torch

    from trtspec.engines.stream import build_graph
    from trtspec.engines.weights import open_weights
    from trtspec.export.checkpoint import load_decoder

    path = make_tiny_gguf(tmp_path / "t.gguf", "qwen2", {**Q4_K_M, "token_embd": embd}, tie=True)
    model = load_decoder(path)
    assert model.spec.tie_word_embeddings
    rec = build_graph(open_weights(path), tmp_path / "q.onnx", torch.float32, quantize="gguf", accuracy_level=1)
    assert rec["matmuls_quantized"] == rec["matmuls_total"] == 2 * 7 + 1 and rec["embedding"] == embd.name
    table = [model.spec.vocab_size, model.spec.hidden_size]
    inits = onnx.load(str(tmp_path / "q.onnx")).graph.initializer
    assert not [i.name for i in inits if i.data_type == TensorProto.FLOAT and sorted(i.dims) == sorted(table)]
    res = gguf_blocks.probe(tmp_path / "q.onnx", path)
    assert all(res.values()) and sum(g.startswith("gguf/token_embd.weight/") for g in res) == 2, res  # gather, head
    graph_steps_like_torch(model, tmp_path / "q.onnx")
