"""ONNX export of the step contract and the ONNX Runtime engine, checked against TorchEngine."""
from __future__ import annotations

import onnx
import pytest
import torch

from trtspec.engines.onnxruntime_engine import OrtEngine
from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.model import Decoder
from trtspec.export.onnx_export import export_onnx, io_names, optimize_for_ort
from trtspec.export.spec import ModelSpec, SpecError

# llama, qwen2 and qwen3 (q/k norms, head_dim 32 != 64 / 4) go through the default (dynamo) exporter;
# mistral, structurally llama, covers the TorchScript fallback so both exporters stay tested; phi3
# (rotary over 3/4 of each head), gemma3 (a windowed layer) and qwen3_moe (routed experts) through dynamo too.
EXPORTER = {"llama": "dynamo", "qwen2": "dynamo", "mistral": "torchscript", "qwen3": "dynamo", "phi3": "dynamo",
            "gemma3": "dynamo", "qwen3_moe": "dynamo"}
ARCHS = list(EXPORTER)
# gemma3: a layer over a 5-key window (with its own rotary base) beside a global one, GeGLU, (1 + w) norms
GEMMA = dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"], local_rope_theta=1000.0,
             query_pre_attn_scalar=24, hidden_act="gelu_pytorch_tanh")
# qwen3_moe: 2 of 4 experts per token in layer 1, a dense MLP in layer 0
MOE = dict(num_experts=4, experts_per_token=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])


def tiny_spec(arch: str) -> ModelSpec:
    qwen = arch == "qwen2"
    return ModelSpec(arch=arch, vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=32 if arch == "qwen3" else 16, rope_theta=10000.0,
                     attention_bias=qwen, tie_word_embeddings=qwen or arch == "qwen3",
                     rotary_dim=12 if arch == "phi3" else None, **(GEMMA if arch == "gemma3" else {}),
                     **(MOE if arch == "qwen3_moe" else {}))


def tiny_model(arch: str, dtype=torch.float32) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(tiny_spec(arch))
    with torch.no_grad():  # weights large enough that attention is not uniform, so masks matter
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    return model.to(dtype).eval()


_exports: dict = {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(arch, dtype) -> (torch model, onnx path); each export is done once per test module."""
    def get(arch: str, dtype=torch.float32):
        key = (arch, dtype)
        if key not in _exports:
            model = tiny_model(arch, dtype)
            path = tmp_path_factory.mktemp("onnx") / f"{arch}_{str(dtype)[6:]}.onnx"
            opset = 18 if EXPORTER[arch] == "dynamo" else 17
            _exports[key] = model, export_onnx(model, path, opset=opset, exporter=EXPORTER[arch])
        return _exports[key]
    return get


# --- step inputs -------------------------------------------------------------------------------

def prefill(gen, start: int, t: int):
    ids = torch.randint(0, 97, (t,), generator=gen)
    mask = torch.ones(t, start + t, dtype=torch.bool).tril(start)
    return ids, torch.arange(start, start + t), mask, torch.arange(t)


def tree(gen, length: int, parents: list[int], t: int):
    """T new nodes of a random tree whose first len(parents) nodes are already scratch rows.

    parents[k] indexes the uncommitted nodes (-1: a root hanging off the committed prefix); each new
    node picks a random earlier node. The mask is ancestor-closed, positions are length + depth."""
    s = len(parents)
    parents = list(parents) + [int(torch.randint(-1, s + k, (1,), generator=gen)) for k in range(t)]
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    mask = torch.zeros(t, length + s + t, dtype=torch.bool)
    mask[:, :length] = True
    for k in range(t):
        node = s + k
        while node >= 0:
            mask[k, length + node] = True
            node = parents[node]
    ids = torch.randint(0, 97, (t,), generator=gen)
    pos = torch.tensor([length + depth[s + k] for k in range(t)])
    rows = torch.randperm(t, generator=gen)[: max(1, t // 2)].sort().values
    return (ids, pos, mask, rows), parents


def assert_step_close(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-4):
    scale = float(b.abs().max()) + 1e-6
    assert a.shape == b.shape and a.dtype == torch.float32
    assert float((a - b).abs().max()) <= rel * scale, f"max diff {float((a - b).abs().max())} (scale {scale})"


def run_both(engines, caches, args, rel=1e-4):
    ref = engines[0].step(caches[0], *args)
    out = engines[1].step(caches[1], *args)
    for cache in caches:
        cache.advance(args[0].shape[0])                # the caller moves the bookkeeping (the Batcher does)
    assert_step_close(out, ref, rel)
    return out


# --- (a) the graph -----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_export_graph_is_standard_onnx(exported, arch):
    model, path = exported(arch)
    onnx.checker.check_model(str(path))
    proto = onnx.load(str(path))
    assert not proto.functions
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    assert all(o.domain in ("", "ai.onnx") for o in proto.opset_import)
    ins, outs = io_names(model.spec.num_layers, model.spec.num_kv_heads)
    assert [v.name for v in proto.graph.input] == ins and [v.name for v in proto.graph.output] == outs
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in [*proto.graph.input, *proto.graph.output]}
    assert dims["attn_mask"] == ["batch", "new_tokens", "total_len"]
    d = model.spec.head_dim
    assert dims["past_key.1.1"] == ["batch", "past_len", d] and dims["new_value.0.0"] == ["batch", "new_tokens", d]
    assert len(ins) == 4 + 2 * model.spec.num_layers * model.spec.num_kv_heads
    assert dims["logits"] == ["batch", "logit_rows", 97]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("exact", [False, True])
def test_attention_reads_the_past_where_it_lies_as_it_lies(arch, exact, tmp_path):
    """Every past_* input (one per layer and KV head, contract v3) goes straight into a product: no
    Concat copies it (a cat of past and new rows copied the whole past each step) and no Transpose
    copies it (contract v2's [B, C, Hkv, D] layout made the graph transpose every layer's past every
    step). The exported graph may only swap a key block's last two axes for the product it feeds (a
    transposed operand), which ONNX Runtime's optimizer folds into FusedMatMul: in the graph the
    engine runs, every past_* input is a product's operand. fp32 and fp64 (exact attention) alike."""
    model = tiny_model(arch).exact_attention() if exact else tiny_model(arch)
    path = export_onnx(model, tmp_path / "g.onnx", opset=18 if EXPORTER[arch] == "dynamo" else 17,
                       exporter=EXPORTER[arch])
    optimized = optimize_for_ort(path, tmp_path / "g.ort.onnx")
    for graph, swap_ok in ((onnx.load(str(path)).graph, True), (onnx.load(str(optimized)).graph, False)):
        consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                consumers.setdefault(name, []).append(node)

        def products(name: str, swap_ok: bool) -> bool:
            nodes = [n for n in consumers.get(name, []) if n.op_type != "Shape"]
            return bool(nodes) and all(
                n.op_type in ("MatMul", "FusedMatMul")
                or (swap_ok and n.op_type == "Transpose" and list(n.attribute[0].ints) == [0, 2, 1]
                    and products(n.output[0], False))
                for n in nodes)

        pasts = [v.name for v in graph.input if v.name.startswith("past_")]
        assert len(pasts) == 2 * model.spec.num_layers * model.spec.num_kv_heads
        for past in pasts:
            assert products(past, swap_ok), f"{past} goes into {[n.op_type for n in consumers.get(past, [])]}"


# --- (b, d) ORT against torch, in place on the cache --------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_ort_matches_torch(exported, arch):
    model, path = exported(arch)
    engines = TorchEngine(model), OrtEngine(path, model.spec, intra_op_threads=1)
    caches = [e.new_cache(48) for e in engines]
    ptr = caches[1].buf.data_ptr()
    gen = torch.Generator().manual_seed(1)

    # prefill chunk over an empty cache (C=0), logits for every row
    run_both(engines, caches, prefill(gen, 0, 7))
    for c in caches:
        c.commit(range(7))
    # one-token decode (T=1)
    logits = run_both(engines, caches, prefill(gen, 7, 1))
    logits_ptr = logits.data_ptr()
    for c in caches:
        c.commit([0])
    # scratch rows (a first tree), then a tree that extends it over committed + scratch rows
    args, parents = tree(gen, 8, [], 4)
    run_both(engines, caches, args)
    for t in (6, 1, 5):
        args, parents = tree(gen, 8, parents, t)
        logits = run_both(engines, caches, args)
        assert logits.data_ptr() == logits_ptr  # engine-owned logits buffer, reused
    # accept a non-prefix path, then decode on top of the compacted cache
    for c in caches:
        c.commit([1, 4, 9])
    run_both(engines, caches, prefill(gen, caches[1].length, 2))

    ref, ort_cache = caches[0], caches[1]
    assert ort_cache.buf.data_ptr() == ptr and ort_cache.used == ref.used
    kv_scale = float(ref.buf.abs().max())
    # the whole buffer, dropped scratch rows included: ORT wrote every row where torch did
    assert float((ort_cache.buf - ref.buf).abs().max()) <= 1e-5 * kv_scale


def test_ort_writes_new_rows_into_cache_in_place(exported):
    model, path = exported("qwen2")
    engine = OrtEngine(path, model.spec, intra_op_threads=1)
    cache = engine.new_cache(16)
    ptr, gen = cache.buf.data_ptr(), torch.Generator().manual_seed(2)
    with torch.no_grad():
        ref = [kv[0] for kv in model(*[x[None] for x in prefill(gen, 0, 5)], model.zero_past())[1]]
    gen.manual_seed(2)
    for step in range(4):  # same tokens as `ref` for the first step, then decodes
        t = 5 if step == 0 else 1
        engine.step(cache, *(prefill(gen, 0, 5) if step == 0 else prefill(gen, cache.used, 1)))
        cache.advance(t)                                   # an engine never moves the bookkeeping
        assert cache.buf.data_ptr() == ptr
        assert cache.buf[:, :, :, cache.used - 1].abs().sum() > 0 and not cache.buf[:, :, :, cache.used:].any()
    for i, kv in enumerate(ref):  # the prefill rows ORT wrote are the model's keys/values
        torch.testing.assert_close(cache.blocks[i][:5], kv, atol=1e-5, rtol=1e-4)


# --- (c) reduced precision ---------------------------------------------------------------------

def test_fp16_export_runs_on_ort_cpu(exported):
    model16, path = exported("qwen2", torch.float16)
    assert onnx.load(str(path), load_external_data=False).graph.input[4].type.tensor_type.elem_type \
        == onnx.TensorProto.FLOAT16
    model32 = tiny_model("qwen2")
    engines = TorchEngine(model32), OrtEngine(path, model16.spec, intra_op_threads=1)
    assert engines[1].kv_dtype == torch.float16
    caches = [engines[0].new_cache(16), engines[1].new_cache(16)]
    gen = torch.Generator().manual_seed(3)
    run_both(engines, caches, prefill(gen, 0, 6), rel=3e-2)  # fp16 against the fp32 reference
    run_both(engines, caches, prefill(gen, 6, 1), rel=3e-2)


def test_bf16_graph_on_ort_cpu_fails_clearly(tmp_path):
    spec = tiny_spec("llama")
    ins, outs = io_names(spec.num_layers, spec.num_kv_heads)
    bf16 = onnx.TensorProto.BFLOAT16
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", [ins[4]], [outs[1]])], "g",
        [onnx.helper.make_tensor_value_info(ins[4], bf16, ["past_len", 2, 16])],
        [onnx.helper.make_tensor_value_info(outs[1], bf16, ["past_len", 2, 16])])
    path = tmp_path / "bf16.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(SpecError, match="bfloat16"):
        OrtEngine(path, spec)


# --- offline ORT optimisation ------------------------------------------------------------------

def test_optimize_for_ort_gives_identical_outputs(exported, tmp_path):
    model, path = exported("qwen2")
    opt = optimize_for_ort(path, tmp_path / "model.ort.onnx")
    engines = OrtEngine(path, model.spec, intra_op_threads=1), OrtEngine(opt, model.spec, intra_op_threads=1)
    caches = [e.new_cache(16) for e in engines]
    gen = torch.Generator().manual_seed(4)
    for args in (prefill(gen, 0, 5), prefill(gen, 5, 1)):
        assert torch.equal(engines[0].step(caches[0], *args).clone(), engines[1].step(caches[1], *args))
        for cache in caches:
            cache.advance(args[0].shape[0])                # the caller moves the bookkeeping
    assert torch.equal(caches[0].buf, caches[1].buf)


def test_dynamo_failure_falls_back_to_torchscript(tmp_path, monkeypatch, caplog):
    import trtspec.export.onnx_export as ox

    def broken(*args, **kwargs):
        raise RuntimeError("simulated torch.export failure")
    monkeypatch.setattr(ox, "_export_dynamo", broken)
    model = tiny_model("llama")
    path = export_onnx(model, tmp_path / "m.onnx")
    assert "retrying with the TorchScript exporter" in caplog.text
    engine, ref = OrtEngine(path, model.spec, intra_op_threads=1), TorchEngine(model)
    args = prefill(torch.Generator().manual_seed(5), 0, 4)
    assert_step_close(engine.step(engine.new_cache(8), *args), ref.step(ref.new_cache(8), *args))


def test_an_experts_row_is_the_same_alone_and_among_others(tmp_path):
    """Routed experts through ONNX Runtime: a token's output alone equals its output among 1-15 other
    tokens bit for bit (each row gathers and multiplies its own experts; the slots are summed one by
    one: a ReduceSum over them took another order for one row than for several at this size)."""
    from trtspec.export.model import MoE
    spec = ModelSpec(arch="qwen3_moe", vocab_size=16, hidden_size=512, intermediate_size=64, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=512, num_experts=16, experts_per_token=8,
                     moe_intermediate_size=64, norm_topk_prob=True)
    torch.manual_seed(0)
    moe = MoE(spec).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    x = torch.randn(1, 16, 512)
    torch.onnx.export(moe, (x,), str(tmp_path / "moe.onnx"), dynamo=True, opset_version=18, input_names=["x"],
                      dynamic_shapes={"x": {1: torch.export.Dim("rows")}})
    import onnxruntime as ort
    sess = ort.InferenceSession(str(tmp_path / "moe.onnx"), providers=["CPUExecutionProvider"])
    full = sess.run(None, {"x": x.numpy()})[0][0]
    with torch.no_grad():
        assert float(abs(full - moe(x)[0].numpy()).max()) <= 1e-5 * float(abs(full).max())
    for t in (1, 2, 3, 8):
        assert (sess.run(None, {"x": x[:, :t].numpy()})[0][0] == full[:t]).all(), t


# --- rotary as one ONNX Runtime node (export/rotary_op.py) ---------------------------------------

@pytest.mark.parametrize("arch", ["llama", "phi3", "gemma3", "qwen3"])
def test_fused_rotary_is_the_plain_formula(arch):
    """Decoder.fused_rotary() computes the same logits and KV bits in torch as the plain form: full and
    partial rotary (phi3), a windowed layer's own base (gemma3), q/k norms first (qwen3)."""
    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(2)
    (ids, pos, mask, rows), _ = tree(gen, 5, [], 6)
    past = [torch.randn(1, 5, model.spec.head_dim, generator=gen) for _ in model.zero_past(1, 5)]
    args = ids[None], pos[None], mask[None], rows[None], past
    plain = model(*args)
    fused = model.fused_rotary()(*args)
    assert torch.equal(plain[0], fused[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], fused[1]))


@pytest.mark.parametrize("dim", [16, 12])
def test_fused_rotary_runs_as_ort_rotary_embedding(dim, tmp_path):
    """The op's translation is com.microsoft.RotaryEmbedding over the step's own (cos, sin) rows, and
    ONNX Runtime computes the torch form to fp32 rounding, the features past `dim` passed through."""
    import onnxruntime as ort

    from trtspec.export.rotary_op import TRANSLATION, rotary

    class Rot(torch.nn.Module):
        def forward(self, x, cos, sin, rows):
            return rotary(x, cos, sin, rows, 3, dim)

    b, t, gen = 2, 5, torch.Generator().manual_seed(3)
    x = torch.randn(b, t, 3 * 16, generator=gen)
    freqs = torch.rand(b * t, dim // 2, generator=gen) * 50
    args = x, freqs.cos(), freqs.sin(), torch.arange(b * t).view(b, t)
    path = tmp_path / "rot.onnx"
    torch.onnx.export(Rot().eval(), args, str(path), dynamo=True, custom_translation_table=TRANSLATION,
                      input_names=["x", "cos", "sin", "rows"], output_names=["y"])
    assert [n.op_type for n in onnx.load(str(path)).graph.node] == ["RotaryEmbedding"]
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        None, dict(zip(["x", "cos", "sin", "rows"], (a.numpy() for a in args))))[0]
    want = rotary(*args, 3, dim)
    assert float((torch.from_numpy(got) - want).abs().max()) <= 1e-6 * float(want.abs().max())
    assert torch.equal(torch.from_numpy(got)[..., dim:16], x[..., dim:16])      # head 0's unrotated features
