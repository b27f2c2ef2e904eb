"""The streaming build (engines/stream.py): a graph exported over fake weights and filled one tensor at
a time gives exactly the outputs of the graph exported from the model in memory, plain, with exact
attention and quantized; ORT's quantizer run over column slices gives the whole weight's bytes; and
an ONNX build never loads the whole model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import helper

from trtspec.engines.quantize import quantize_matmul
from trtspec.export.onnx_export import _probe_outputs, export_onnx, optimize_for_ort
from trtspec.engines.stream import build_graph, export_graph
from trtspec.export.tiny import tiny_pair, tiny_spec
from trtspec.engines.weights import StateWeights

from test_gguf_blocks import tiny_gguf  # noqa: F401,F811  (a module fixture: GGUF files of both architectures)


def same(a, b) -> bool:
    return all(x.shape == y.shape and (x == y).all() for x, y in zip(_probe_outputs(a), _probe_outputs(b)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("exact", [False, True])
def test_a_streamed_graph_is_the_exported_graph(arch, exact, tmp_path):
    spec = tiny_spec(arch=arch)
    model, _ = tiny_pair(spec, seed=3)
    if exact:
        model.exact_attention()
    export_onnx(model, tmp_path / "memory.onnx")
    rec = build_graph(StateWeights(spec, model.state_dict()), tmp_path / "stream.onnx", torch.float32, exact)
    assert rec["matmuls_quantized"] == 0 and rec["matmuls_total"] == 7 * spec.num_layers + 1
    assert same(tmp_path / "memory.onnx", tmp_path / "stream.onnx")
    optimize_for_ort(tmp_path / "stream.onnx", tmp_path / "stream.ort.onnx")
    assert same(tmp_path / "memory.onnx", tmp_path / "stream.ort.onnx")


def test_the_weightless_graph_names_every_weight():
    spec = tiny_spec(arch="qwen2")
    graph, refs = export_graph(spec, torch.float32)
    keys = {r.key for r in refs.values()}
    model, _ = tiny_pair(spec, seed=0)
    assert keys == set(StateWeights(spec, model.state_dict()).shapes)
    assert not [i for i in graph.graph.initializer if i.name in refs]      # placeholders: no bytes yet
    assert all(r.transposed == (len(r.shape) == 2 and r.key != "model.embed_tokens.weight") for r in refs.values())


@pytest.mark.parametrize("k,n", [(64, 100), (96, 77), (40, 33)])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_quantizer_over_column_slices_gives_the_whole_weight(k, n, bits):
    w = np.random.default_rng(k + n).standard_normal((k, n), dtype=np.float32)
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    whole, sliced = quantize_matmul(node, w, bits, 4), quantize_matmul(node, w, bits, 4, columns=16)
    assert [str(nd) for nd in whole[0]] == [str(nd) for nd in sliced[0]]
    assert [(t.name, list(t.dims), t.raw_data) for t in whole[1]] == [(t.name, list(t.dims), t.raw_data) for t in sliced[1]]


def test_an_onnx_build_never_loads_the_whole_model(tiny_gguf, tmp_path, monkeypatch):
    """The build's source for a model file (here a tiny GGUF with a Q4_K_M file's block types) reads
    one tensor at a time: the loaders that return a whole state dict are never called."""
    from trtspec.assembly.config import ModelEntry
    from trtspec.assembly.sources import open_source
    from trtspec.engines import gguf_blocks
    from trtspec.export import checkpoint, gguf_loader

    def whole(*a, **k):
        raise AssertionError("the build loaded the whole model")
    monkeypatch.setattr(checkpoint, "load_checkpoint", whole)
    monkeypatch.setattr(gguf_loader, "load_gguf", whole)
    weights = open_source(ModelEntry(model=str(tiny_gguf), quantize="gguf"), "target")
    rec = build_graph(weights, tmp_path / "q.onnx", torch.float32, exact=True, quantize="gguf", accuracy_level=4)
    assert rec["matmuls_quantized"] == 15
    assert all(gguf_blocks.probe(tmp_path / "q.onnx", tiny_gguf).values())


def test_the_graph_cache_exports_once_and_survives_a_bad_entry(tmp_path, monkeypatch):
    """A second export of the same spec comes from $TRTSPEC_CACHE/graphs; another spec, dtype or
    attention is another entry; an unreadable entry is exported again, never an error."""
    from trtspec.engines import stream
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    calls = []

    def fake_export(spec, dtype, exact, opset, hidden=False, fused=()):
        calls.append((spec.num_layers, dtype, exact, fused, hidden))
        x = helper.make_tensor_value_info("x", 1, [1])
        return helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x],
                                                   [helper.make_tensor_value_info("y", 1, [1])])), \
            {"w": stream.Ref("model.embed_tokens.weight", False, (4, 2), 1)}
    monkeypatch.setattr(stream, "_export_graph", fake_export)
    spec = tiny_spec(arch="llama")
    first = export_graph(spec, torch.float32)
    assert export_graph(spec, torch.float32) == first and len(calls) == 1
    export_graph(spec, torch.float32, exact=True)
    export_graph(tiny_spec(arch="llama", num_layers=3), torch.float32)
    export_graph(spec, torch.float32, hidden=True)                # the hidden rows: another entry
    assert len(calls) == 4 and calls[-1][-1] is True
    export_graph(spec, torch.float32, fused=("experts",))         # fused experts: another entry
    assert len(calls) == 5 and calls[-1][-2] == ("experts",)
    export_graph(spec, torch.float32, fused=("rotary",))          # fused rotary: another entry
    assert len(calls) == 6 and calls[-1][-2] == ("rotary",)
    for e in (tmp_path / "graphs").glob("*.onnx"):
        e.write_bytes(b"not a graph")
    assert export_graph(spec, torch.float32) == first and len(calls) == 7
    assert not list((tmp_path / "graphs").glob("*.tmp"))        # nothing half-written left


def test_the_export_worker_answers_the_in_place_export_and_fails_softly(tmp_path, monkeypatch):
    """The build's draft export runs as `python -m trtspec.engines.export_worker` (a plain process:
    never a re-run of the caller's main script): its answer is the in-place export's graph and refs;
    a worker that fails answers None with its last line, and the build exports in place."""
    from trtspec.engines.export_worker import ExportJob
    from trtspec.engines.stream import export_graph_bytes
    monkeypatch.setenv("TRTSPEC_CACHE", str(tmp_path))
    spec = tiny_spec(arch="qwen2").to_dict()
    job = ExportJob(spec, "fp32", False, 18)
    try:
        got = job.get()
    finally:
        job.close()
    assert got is not None and got == export_graph_bytes(spec, "fp32", False, 18)    # the second: cached
    bad = ExportJob(spec, "fp7", False, 18)
    try:
        assert bad.get() is None and "KeyError" in bad.error()
    finally:
        bad.close()
