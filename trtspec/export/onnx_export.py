"""Export the Decoder step contract to ONNX (standard ops only, so TensorRT's parser reads the file).

Graph interface (names are the contract every engine binds by):

    inputs   input_ids int64 [batch, new_tokens]   position_ids int64 [batch, new_tokens]
             attn_mask bool [batch, new_tokens, total_len] (total_len = past_len + new_tokens)
             logit_rows int64 [batch, logit_rows]  past_key.{i}.{h} / past_value.{i}.{h} [batch, past_len, D]
    outputs  logits float32 [batch, logit_rows, V] new_key.{i}.{h} / new_value.{i}.{h} [batch, new_tokens, D]

(one KV tensor per layer i and KV head h: contract v3, export/contract.py).

KV tensors are in the model dtype (fp32 / fp16 / bf16). The exporter is torch.export-based
(`dynamo=True`, the default since torch 2.9): it sees symbolic shapes rather than tracing sizes,
its onnxscript optimizer folds the graph to plain Gemm/MatMul/Softmax, and tied embeddings are
stored once. It needs opset >= 18. The legacy TorchScript exporter (deprecated, opset 17 capable)
is kept as a fallback for when torch.export fails.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from pathlib import Path

import onnx
import onnx.inliner
import torch
from torch import nn

from .contract import io_names
from .model import Decoder

EXTERNAL_DATA_MIN_BYTES = 100 * 2**20   # above this, weights go to "<file>.data" (protobuf caps at 2 GB)
STANDARD_DOMAINS = ("", "ai.onnx")

_TORCH_TO_ONNX = {torch.float32: onnx.TensorProto.FLOAT, torch.float16: onnx.TensorProto.FLOAT16,
                  torch.bfloat16: onnx.TensorProto.BFLOAT16, torch.float64: onnx.TensorProto.DOUBLE}

log = logging.getLogger(__name__)


class _Step(nn.Module):
    """Flat positional signature (one graph input per past tensor) around `Decoder.forward`."""

    def __init__(self, model: Decoder):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, attn_mask, logit_rows, *past):
        logits, new_kv, *hidden = self.model(input_ids, position_ids, attn_mask, logit_rows, list(past))
        return (logits, *new_kv, *hidden)                  # hidden: with the model's `hidden_rows`


def _sample_inputs(model: Decoder):
    # Sizes >= 2 and pairwise distinct (B=2, T=3, C=5, R=4), so torch.export neither specialises a
    # dim to 0/1 nor unifies two dims that merely happen to be equal in the example. Attention by
    # logical order cuts the keys into chunks: 5 of them (C = 4 chunks + 5), not one.
    chunk = model.model.layers[0].self_attn.chunk
    b, t, c = 2, 3, 4 * chunk + 5 if chunk else 5
    return (torch.arange(t).repeat(b, 1), torch.arange(c, c + t).repeat(b, 1),
            torch.ones(b, t, c + t, dtype=torch.bool).tril(c), torch.tensor([[0, 1, 2, 2]] * b),
            *model.zero_past(b, c))


def _export_dynamo(step: _Step, args, path: Path, opset: int, external: bool) -> None:
    n_past, s = len(args) - 4, step.model.spec
    Dim = torch.export.Dim
    batch, new, past, rows = Dim("batch"), Dim("new_tokens"), Dim("past_len", min=0), Dim("logit_rows")
    shapes = {"input_ids": {0: batch, 1: new}, "position_ids": {0: batch, 1: new},
              # past_len + new_tokens is not expressible as a derived Dim; AUTO lets export find it.
              "attn_mask": {0: batch, 1: new, 2: Dim.AUTO},
              "logit_rows": {0: batch, 1: rows}, "past": tuple({0: batch, 1: past} for _ in range(n_past))}
    inputs, outputs = io_names(s.num_layers, s.num_kv_heads, step.model.hidden_rows)
    program = torch.onnx.export(step, args, dynamo=True, opset_version=opset, dynamic_shapes=shapes,
                                input_names=inputs, output_names=outputs, verbose=False)
    program.save(str(path), external_data=external)


def _export_torchscript(step: _Step, args, path: Path, opset: int, external: bool) -> None:
    inputs, outputs = io_names(step.model.spec.num_layers, step.model.spec.num_kv_heads, step.model.hidden_rows)
    axes = {"input_ids": {0: "batch", 1: "new_tokens"}, "position_ids": {0: "batch", 1: "new_tokens"},
            "attn_mask": {0: "batch", 1: "new_tokens", 2: "total_len"}, "logit_rows": {0: "batch", 1: "logit_rows"},
            "logits": {0: "batch", 1: "logit_rows"}}
    axes.update({n: {0: "batch", 1: "past_len"} for n in inputs[4:]})
    axes.update({n: {0: "batch", 1: "new_tokens"} for n in outputs[1:] if n.startswith("new_")})
    axes.update({n: {0: "batch", 1: "logit_rows"} for n in outputs if n == "hidden"})
    torch.onnx.export(step, args, str(path), dynamo=False, opset_version=opset, input_names=inputs,
                      output_names=outputs, dynamic_axes=axes, do_constant_folding=True)
    if external:  # the legacy exporter inlines weights up to 2 GB; move them out like the dynamo path
        save_graph(onnx.load(str(path)), path, external=True)


def data_file(path: Path) -> Path:
    """Where a graph at `path` keeps its external weights (one file: "<name>.data")."""
    return path.with_name(path.name + ".data")


def remove_graph(path: Path) -> None:
    """Delete a graph and its external weights, if there."""
    for f in (path, data_file(path)):
        f.unlink(missing_ok=True)


def save_graph(proto: onnx.ModelProto, path: Path, external: bool) -> None:
    """Save `proto` at `path`, its weights in one external file when `external`."""
    onnx.save_model(proto, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=data_file(path).name, size_threshold=1024)


def _fix_interface(path: Path, model: Decoder) -> None:
    """fix_interface on the graph at `path`; loads only the graph, so external weights are untouched."""
    proto = onnx.load(str(path), load_external_data=False)
    onnx.save_model(fix_interface(proto, model.spec, model.kv_dtype, model.hidden_rows), str(path))


def fix_interface(proto: onnx.ModelProto, s, kv_dtype: torch.dtype, hidden: bool = False,
                  ort_only: bool = False) -> onnx.ModelProto:
    """Stamp the contract's names/dims on the graph I/O (exporters name total_len 's93' etc.) and
    reject non-standard domains (but ONNX Runtime's own where `ort_only`). `hidden`: the graph also
    returns the hidden rows."""
    kv = _TORCH_TO_ONNX[kv_dtype]
    i64, b = onnx.TensorProto.INT64, onnx.TensorProto.BOOL
    want = {"input_ids": (i64, ["batch", "new_tokens"]), "position_ids": (i64, ["batch", "new_tokens"]),
            "attn_mask": (b, ["batch", "new_tokens", "total_len"]), "logit_rows": (i64, ["batch", "logit_rows"]),
            "logits": (onnx.TensorProto.FLOAT, ["batch", "logit_rows", s.vocab_size])}
    inputs, outputs = io_names(s.num_layers, s.num_kv_heads, hidden)
    want.update({n: (kv, ["batch", "past_len", s.head_dim]) for n in inputs[4:]})
    want.update({n: (kv, ["batch", "new_tokens", s.head_dim]) for n in outputs[1:]})
    want["hidden"] = (onnx.TensorProto.FLOAT, ["batch", "logit_rows", s.hidden_size])
    g = proto.graph
    got = [v.name for v in g.input], [v.name for v in g.output]
    if got != (inputs, outputs):
        raise RuntimeError(f"exported graph I/O {got} does not match the step contract {(inputs, outputs)}")
    for v in [*g.input, *g.output]:
        elem, dims = want[v.name]
        if v.type.tensor_type.elem_type != elem:
            raise RuntimeError(f"{v.name} exported as ONNX type {v.type.tensor_type.elem_type}, expected {elem}")
        v.CopyFrom(onnx.helper.make_tensor_value_info(v.name, elem, dims))
    if proto.functions:  # TensorRT's parser does not take local functions
        proto = onnx.inliner.inline_local_functions(proto)
    # (a fused experts node, export/experts_op.py, is replaced by the build before any engine reads it;
    # `ort_only`: a graph for ONNX Runtime alone, with its contrib ops: export/rotary_op.py)
    odd = sorted({n.domain for n in proto.graph.node if n.domain not in STANDARD_DOMAINS} - {"trtspec"}
                 - ({"com.microsoft"} if ort_only else set()))
    if odd:
        raise RuntimeError(f"exported graph uses non-standard op domains {odd}; TensorRT cannot parse them")
    return proto


@contextlib.contextmanager
def _quiet_exporter():
    """The exporters' chatter is not actionable for users of this contract (axis-name sharing,
    torchvision op registration, TorchScript deprecation); real failures still raise."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._export", "onnx_ir", "onnxscript")]
    levels = [lg.level for lg in loggers]
    with warnings.catch_warnings():
        for cat in (UserWarning, FutureWarning, DeprecationWarning, torch.jit.TracerWarning):
            warnings.filterwarnings("ignore", category=cat)
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, lvl in zip(loggers, levels):
                lg.setLevel(lvl)


def export_onnx(model: Decoder, path: str | os.PathLike, opset: int = 18, exporter: str = "dynamo",
                external_data: bool | None = None) -> Path:
    """Write `model` (already cast to fp32/fp16/bf16) as an ONNX step graph at `path`; returns the path.

    exporter: "dynamo" (torch.export, opset >= 18; falls back to "torchscript" if torch.export
    fails) or "torchscript" (legacy, opset >= 17). external_data: None = only above 100 MB."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = model.model.embed_tokens.weight.dtype
    if dtype not in _TORCH_TO_ONNX:
        raise ValueError(f"model dtype {dtype} is not exportable; cast to float32, float16 or bfloat16")
    if exporter not in ("dynamo", "torchscript"):
        raise ValueError(f"exporter must be 'dynamo' or 'torchscript', not {exporter!r}")
    if exporter == "dynamo" and opset < 18:
        raise ValueError("the dynamo exporter emits opset >= 18 (its down-conversion to 17 fails on "
                         "ReduceMean); pass opset=18+ or exporter='torchscript'")
    if external_data is None:
        external_data = sum(p.numel() * p.element_size() for p in model.parameters()) > EXTERNAL_DATA_MIN_BYTES
    remove_graph(path)                   # never leave an old weight file behind

    step = _Step(model.eval()).eval()
    args = _sample_inputs(model)
    t0 = time.perf_counter()
    with torch.no_grad(), _quiet_exporter():
        if exporter == "dynamo":
            try:
                _export_dynamo(step, args, path, opset, external_data)
            except Exception as e:  # noqa: BLE001 - any torch.export failure: try the other exporter
                log.warning("dynamo ONNX export failed (%s: %s); retrying with the TorchScript exporter",
                            type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                exporter = "torchscript"
        if exporter == "torchscript":
            _export_torchscript(step, args, path, opset, external_data)
    _fix_interface(path, model)
    onnx.checker.check_model(str(path), full_check=False)  # path-based: works with external data
    log.info("exported %s with the %s exporter in %.1fs", path, exporter, time.perf_counter() - t0)
    return path


def optimize_for_ort(onnx_path: str | os.PathLike, out_path: str | os.PathLike, level: str = "extended",
                     verify: bool = True) -> Path:
    """Save ONNX Runtime's offline-optimised graph for the ORT engine folder (not for TensorRT).

    "extended" adds ORT contrib fusions (com.microsoft FusedMatMul, QuickGelu for SiLU) fitted to the
    CPU provider used here; "basic" (constant folding, redundant-node removal) keeps standard ops.
    With verify, the saved file is loaded back and must give bit-identical outputs to the source on
    a probe step, else the next lower level is used (and if none does, this raises)."""
    import onnxruntime as ort

    onnx_path, out_path = Path(onnx_path), Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    levels = {"extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}
    big = onnx_path.stat().st_size + _external_size(onnx_path) > EXTERNAL_DATA_MIN_BYTES
    want = _probe_outputs(onnx_path) if verify else None
    for name in list(levels)[list(levels).index(level):]:
        data = data_file(out_path)
        remove_graph(out_path)
        so = ort.SessionOptions()
        so.graph_optimization_level = levels[name]
        so.optimized_model_filepath = str(out_path)
        so.add_session_config_entry("session.disable_prepacking", "1")   # no kernel copy of the weights
        if big:
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", data.name)
            so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])  # writes out_path
        if want is None:
            return out_path
        got = _probe_outputs(out_path)
        if all(a.shape == b.shape and (a == b).all() for a, b in zip(want, got)):
            return out_path
        log.warning("ORT %s-optimised model differs from %s on a probe step; trying a lower level", name, onnx_path)
    raise RuntimeError(f"no ORT optimisation level reproduces {onnx_path} exactly; use the file unoptimised")


def _probe_outputs(path: Path) -> list:
    """Outputs of one small tree step (C=2 past rows, T=3 new) through a default ORT CPU session."""
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()        # the same kernels on both sides; no prepacked copy of the weights
    so.add_session_config_entry("session.disable_prepacking", "1")
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    b, c, t, feed = 2, 2, 3, {}
    mask = np.tril(np.ones((b, t, c + t), dtype=bool), c)
    mask[:, 2, c + 1] = False  # a branch: node 2 is a sibling of node 1, not its child
    mask[1, :, 0] = False      # the second row has one past row fewer
    for i in sess.get_inputs():
        if i.name.startswith("past_"):
            dt = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}[i.type]
            feed[i.name] = rng.standard_normal((b, c, *i.shape[2:])).astype(dt)
    feed.update(input_ids=np.array([[1, 2, 3], [4, 5, 6]]), position_ids=np.array([[2, 3, 3], [1, 2, 2]]),
                attn_mask=mask, logit_rows=np.array([[0, 2], [1, 2]]))
    return sess.run(None, feed)


def _external_size(path: Path) -> int:
    data = data_file(path)
    return data.stat().st_size if data.exists() else 0
