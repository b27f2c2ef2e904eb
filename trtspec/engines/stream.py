"""A step graph built without the model in memory: the graph from a weightless Decoder, the
weights written into it one tensor at a time.

    graph, refs = export_graph(spec, dtype, exact)      # torch.export over fake weights (no memory)
    record = write_graph(graph, refs, weights, path, quantize=..., accuracy_level=...)

`export_graph` exports a Decoder whose parameters are FakeTensors (shapes and dtypes, no storage)
with the same exporter as `export_onnx`, then runs the exporter's own optimizer (onnxscript) over
the graph with the weights left out. Linear layers come out as MatMul(x, Transpose(W)); each such
Transpose of a weight becomes a placeholder initializer holding Wᵀ, as the exporter's constant
folding makes it when the weights are real. `refs` says which weight (and whether transposed)
each placeholder is. The weightless graph depends only on the spec, dtype, attention and the
exporting code, so it is kept under `$TRTSPEC_CACHE/graphs/` (a few MB; the export takes minutes on
a small CPU): rebuilding a model, or building it quantized another way, exports it once.

`write_graph` fills the placeholders in graph order, reading each weight from its source
(`engines/weights.py`), converting it (`quantize: gguf`: the GGUF's own blocks as MatMulNBits terms,
gguf_blocks.py; `int4`/`int8`: ONNX Runtime's MatMulNBitsQuantizer, run on that one MatMul), and
appending its bytes to the graph's external-data file before the next is read: the build holds one
tensor (and what it becomes) at a time, never the model. In a quantized build the MatMuls that
read one input (q/k/v, gate/up) are one joined product (one group of tensors at a time), an
embedding stored in blocks is gathered from them, and a draft's LM head may be reduced to some
tokens (`head`, head_vocab.py).
"""
from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from dataclasses import astuple, dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..export.contract import io_names
from ..export.packs import cache_dir, write_atomic
from ..export.model import Decoder
from ..export.spec import ModelSpec
from .qmoe import experts_nodes, is_experts
from .quantize import fused_experts, fused_ops

log = logging.getLogger(__name__)
INLINE_BYTES = 1024          # smaller tensors stay inside the graph file (as onnx.save's threshold)
ALIGN = 64                   # external data offsets


@dataclass(frozen=True)
class Ref:
    key: str                 # the HF-named weight
    transposed: bool         # the placeholder holds Wᵀ (a MatMul's B)
    shape: tuple[int, ...]   # the placeholder's shape
    dtype: int               # TensorProto data type


def _fake_decoder(spec: ModelSpec, dtype: torch.dtype, exact: bool | str, fused: tuple[str, ...] = ()) -> Decoder:
    from torch._subclasses.fake_tensor import FakeTensorMode
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)                # parameters made in `dtype` (fake ones cannot be cast)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = Decoder(spec)
    finally:
        torch.set_default_dtype(default)
    model.reset_rotary()                          # real (tiny) buffers, as Decoder.from_state makes them
    if exact == "logical":
        model.logical_attention()
    elif exact:
        model.exact_attention()
    if "experts" in fused:
        model.fused_experts()
    if "rotary" in fused:
        model.fused_rotary()
    return model.eval().requires_grad_(False)


def export_graph(spec: ModelSpec, dtype: torch.dtype, exact: bool | str = False, opset: int = 18,
                 hidden: bool = False, fused: tuple[str, ...] = ()) -> tuple[onnx.ModelProto, dict[str, Ref]]:
    """The step graph of `spec` in `dtype` (exact attention when `exact`: fp64, or "logical"; the hidden rows too with
    `hidden`, export/contract.py; with `fused` (quantize.fused_ops), rotary as one ONNX Runtime node per
    tensor, and a mixture's experts as one node per layer for the build to replace: engines/qmoe.py),
    weightless: every weight is a placeholder initializer named in `refs`; from the graph cache when it
    holds it."""
    path = _cached_graph(spec, dtype, exact, opset, hidden, fused)
    try:
        refs = {k: Ref(r[0], r[1], tuple(r[2]), r[3]) for k, r in json.loads(path.with_suffix(".json").read_text()).items()}
        return onnx.load(str(path)), refs
    except Exception:                                 # noqa: BLE001 - not cached (or unreadable): export it
        pass
    graph, refs = _export_graph(spec, dtype, exact, opset, hidden, fused)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, graph.SerializeToString())
        write_atomic(path.with_suffix(".json"), json.dumps({k: astuple(r) for k, r in refs.items()}))  # last
    except OSError:
        pass                                          # a read-only cache only costs the next export
    return graph, refs


def optimize(model) -> None:
    """onnxscript's optimizer over an exported graph, in place: optimize_ir's own passes less one
    rewrite rule, SlicesSplit (several Slices of one tensor as one Split). It never fired on our
    graphs (no Split with it; the same graph without it, tests/e2e/test_onnx_optimize.py)
    and matches multi-output patterns over the whole graph for each node, so its time grows with the
    square of the graph: 90% of the rewriter's time, and 320 s of the logical-order 1.5B target's
    540 s export (py-spy, 2026-12-07). Where this onnxscript lays its passes out otherwise,
    optimize_ir itself."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    import onnxscript.optimizer
    from onnxscript import rewriter
    try:
        from onnxscript.optimizer import _constant_folding as fold
        rules = [r for r in rewriter._DEFAULT_REWRITE_RULES if getattr(r, "name", None) != "SlicesSplit"]
        limits = fold.DEFAULT_CONSTANT_FOLD_INPUT_SIZE_LIMIT, fold.DEFAULT_CONSTANT_FOLD_OUTPUT_SIZE_LIMIT
    except (ImportError, AttributeError):
        onnxscript.optimizer.optimize_ir(model)
        return
    loop = ir.passes.PassManager([fold.FoldConstantsPass(shape_inference=True, input_size_limit=limits[0],
                                                         output_size_limit=limits[1], should_fold=lambda node: None),
                                  rewriter.RewritePass(rules), common.RemoveUnusedNodesPass(),
                                  common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass()],
                                 steps=2, early_stop=True)
    ir.passes.Sequential(common.InlinePass(), loop, common.RemoveUnusedNodesPass(),
                         common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
                         common.LiftSubgraphInitializersToMainGraphPass(), common.DeduplicateInitializersPass(),
                         common.CommonSubexpressionEliminationPass(), common.OutputFixPass(),
                         common.NameFixPass())(model)


def _cached_graph(spec: ModelSpec, dtype: torch.dtype, exact: bool | str, opset: int, hidden: bool = False,
                  fused: tuple[str, ...] = ()) -> Path:
    """Where the graph cache keeps this export: keyed by everything that shapes it, the code included."""
    import onnxscript

    from ..export import contract, experts_op, model, onnx_export, rotary_op
    h = hashlib.sha256(json.dumps([spec.to_dict(), str(dtype), exact, opset, torch.__version__,
                                   onnxscript.__version__, onnx.__version__] + ([True] if hidden else []) +
                                  list(fused),
                                  sort_keys=True, default=str).encode())
    for module in (contract, experts_op, model, onnx_export, rotary_op, sys.modules[__name__]):
        h.update(Path(module.__file__).read_bytes())
    return cache_dir() / "graphs" / f"{h.hexdigest()[:24]}.onnx"


def _export_graph(spec: ModelSpec, dtype: torch.dtype, exact: bool | str, opset: int,
                  hidden: bool = False, fused: tuple[str, ...] = ()) -> tuple[onnx.ModelProto, dict[str, Ref]]:
    from torch._subclasses.fake_tensor import FakeTensor

    from ..export.onnx_export import _quiet_exporter, _sample_inputs, _Step, fix_interface

    from ..export import experts_op, rotary_op
    model = _fake_decoder(spec, dtype, exact, fused)
    model.hidden_rows = hidden
    step, args = _Step(model), _sample_inputs(model)
    n_past, Dim = len(args) - 4, torch.export.Dim
    batch, new, past, rows = Dim("batch"), Dim("new_tokens"), Dim("past_len", min=0), Dim("logit_rows")
    shapes = {"input_ids": {0: batch, 1: new}, "position_ids": {0: batch, 1: new},
              "attn_mask": {0: batch, 1: new, 2: Dim.AUTO},
              "logit_rows": {0: batch, 1: rows}, "past": tuple({0: batch, 1: past} for _ in range(n_past))}
    inputs, outputs = io_names(spec.num_layers, spec.num_kv_heads, hidden)
    with torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(step, args, dynamo=True, opset_version=opset, dynamic_shapes=shapes,
                                    input_names=inputs, output_names=outputs, verbose=False, optimize=False,
                                    custom_translation_table={**experts_op.TRANSLATION, **rotary_op.TRANSLATION})
        weights = {}
        for name, v in program.model.graph.initializers.items():
            if isinstance(getattr(v.const_value, "raw", None), FakeTensor):
                weights[name] = (tuple(int(d) for d in v.shape), int(v.dtype))
                v.const_value = None                  # the optimizer folds around it, never into it
        optimize(program.model)
        import onnx_ir as ir
        proto = ir.serde.serialize_model(program.model)   # value-less initializers are left out
    del program
    return (fix_interface(proto, spec, model.kv_dtype, hidden, ort_only="rotary" in fused),
            _placeholders(proto, weights, spec))


def _key(name: str, spec: ModelSpec) -> str:
    key = name.removeprefix("model.")                 # _Step's attribute
    return "model.embed_tokens.weight" if spec.tie_word_embeddings and key == "lm_head.weight" else key


def _placeholders(proto: onnx.ModelProto, weights: dict, spec: ModelSpec) -> dict[str, Ref]:
    """Fold Transpose(weight) into a placeholder for Wᵀ; keep the weight's own placeholder where
    anything else reads it (the embedding's Gather)."""
    g = proto.graph
    used: dict[str, list] = {name: [] for name in weights}
    for n in g.node:                              # one pass over the graph, not one per weight
        for i in dict.fromkeys(n.input):
            if i in used:
                used[i].append(n)
    refs, drop = {}, []
    for name, (shape, dtype) in weights.items():
        rest = 0
        for node in used[name]:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            if node.op_type == "Transpose" and len(shape) == 2 and perm in (None, [1, 0]):
                refs[node.output[0]] = Ref(_key(name, spec), True, shape[::-1], dtype)
                drop.append(node)
            else:
                rest += 1
        if rest:
            refs[name] = Ref(_key(name, spec), False, shape, dtype)
    for node in drop:
        g.node.remove(node)
    return refs


class DataFile:
    """Appends tensors to a graph's external-data file and gives back references to them (or keeps
    them inline when the whole graph is small). Bytes go from the tensor's own buffer to the file."""

    def __init__(self, graph_path: Path, external: bool):
        from ..export.onnx_export import data_file
        self.path, self.external, self.offset = data_file(graph_path), external, 0
        self.file = open(self.path, "wb") if external else None

    def put(self, t: TensorProto) -> TensorProto:
        if not self.external or len(t.raw_data) < INLINE_BYTES:
            return t
        return self._ref(t.name, t.data_type, list(t.dims), memoryview(t.raw_data))

    def put_tensor(self, name: str, value: torch.Tensor, dtype: int) -> TensorProto:
        """`value` (any dtype, bf16 included) as the initializer `name`."""
        v = value.contiguous()
        data = v.view(torch.uint8).numpy() if v.numel() else np.zeros(0, np.uint8)
        if not self.external or data.nbytes < INLINE_BYTES:
            return helper.make_tensor(name, dtype, list(v.shape), data.tobytes(), raw=True)
        return self._ref(name, dtype, list(v.shape), memoryview(data.reshape(-1)))

    def _ref(self, name: str, dtype: int, dims: list[int], data: memoryview) -> TensorProto:
        pad = -self.offset % ALIGN
        self.file.write(b"\0" * pad)
        self.offset += pad
        self.file.write(data)
        out = TensorProto(name=name, data_type=dtype, dims=dims, data_location=TensorProto.EXTERNAL)
        for k, v in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(data.nbytes))):
            out.external_data.add(key=k, value=v)
        self.offset += data.nbytes
        return out

    def close(self) -> None:
        if self.file:
            self.file.close()


def write_graph(proto: onnx.ModelProto, refs: dict[str, Ref], weights, path: Path, quantize: str = "none",
                accuracy_level: int = 1, progress=None, head: np.ndarray | None = None) -> dict:
    """Fill `proto`'s placeholders from `weights`, one tensor at a time, and save it at `path`
    (weights in `path`.data when large). `quantize`: gguf / int4 / int8 replace every MatMul whose B
    is a weight (gguf: one the GGUF stores quantized). `head`: the token ids of a reduced LM head
    (engines/head_vocab.py). Returns {"matmuls_quantized", "matmuls_total" (the MatMuls with a
    weight), "block_types", "joined_products", "embedding" (dense or the block type it is gathered
    from)}. On any error nothing is left at `path`."""
    from ..export.onnx_export import EXTERNAL_DATA_MIN_BYTES, remove_graph
    t0 = time.perf_counter()
    remove_graph(path)
    if head is not None:
        weights = _reduce_head(proto, refs, weights, head)
    size = sum(int(np.prod(r.shape)) * _itemsize(r.dtype) for r in refs.values())
    out = DataFile(path, external=size > EXTERNAL_DATA_MIN_BYTES)
    try:
        counts = _fill(proto, refs, weights, out, quantize, accuracy_level, progress or (lambda: None))
        out.close()
        onnx.save_model(proto, str(path))
        onnx.checker.check_model(str(path), full_check=False)
    except BaseException:
        out.close()
        remove_graph(path)
        raise
    log.info("wrote %s (%s) in %.1fs", path, quantize, time.perf_counter() - t0)
    return counts


def _reduce_head(proto: onnx.ModelProto, refs: dict[str, Ref], weights, ids: np.ndarray):
    """Make the LM head's MatMul read the rows `ids` of the head (its own weight, so a quantizer
    takes it even when the model ties it to the embedding) and spread its logits over the whole
    vocabulary (head_vocab.head_nodes). Returns the weights that serve those rows."""
    from .head_vocab import head_nodes
    from .weights import HeadRows
    g = proto.graph
    node = next(n for n in g.node if "logits" in n.output)
    ref = refs.get(node.input[1]) if node.op_type == "MatMul" else None
    if ref is None or not ref.transposed:
        raise ValueError("the graph's logits do not come from a MatMul by the LM head; a reduced head cannot "
                         "be made for this graph")
    refs["head/weight"] = Ref(HeadRows.HEAD, True, (ref.shape[0], len(ids)), ref.dtype)
    node.input[1], node.output[0] = "head/weight", "head/logits"
    nodes, inits = head_nodes("head/logits", "logits", ids, weights.spec.vocab_size)
    g.node.extend(nodes)
    g.initializer.extend(inits)
    return HeadRows(weights, ids)


def _fill(proto: onnx.ModelProto, refs: dict[str, Ref], weights, out: DataFile, quantize: str, level: int,
          progress) -> dict:
    g = proto.graph
    inits = [out.put(t) for t in g.initializer]
    matmuls = [n for n in g.node if n.op_type == "MatMul" and n.input[1] in refs and refs[n.input[1]].transposed]
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    replaced, counts, joined, embedding = {}, {}, 0, "dense"
    for group in _groups(matmuls, refs, weights, quantize) if quantize != "none" else []:
        new = _replace(group, refs, weights, quantize, level)    # quantized forms first, one product at a time
        if new is None:
            continue
        replaced[group[0].name] = new[0]
        for node in group:
            replaced.setdefault(node.name, [])
            readers[node.input[1]] -= 1
            progress()
        inits += [out.put(t) for t in new[1]]
        counts[new[2]] = counts.get(new[2], 0) + len(group)
        joined += len(group) > 1
        release_memory()
    gathers = [n for n in g.node if n.op_type == "Gather" and n.input[0] in refs and not refs[n.input[0]].transposed]
    fused = [n for n in g.node if is_experts(n)]           # a mixture's experts, one node per layer (quantized build)
    experts = {"experts_total": 3 * len(fused) + sum(len(refs[n.input[0]].shape) == 3 for n in gathers),
               "experts_quantized": 0}
    gathered: set[str] = set()                             # the block types experts are gathered from
    for node in fused:
        if not fused_experts(weights.spec, quantize):
            raise ValueError(f"{node.name}: a graph with fused experts is built with quantize int4, not {quantize}")
        nodes, new_inits = experts_nodes(node, weights, weights.spec, level)
        replaced[node.name] = nodes
        inits += [out.put(t) for t in new_inits]
        experts["experts_quantized"] += 3
        experts["experts"] = f"{quantize}: com.microsoft.QMoE, one row per call"
        del new_inits
        release_memory()
        progress()
    for node in gathers if quantize != "none" else []:     # embeddings and experts: gathered from blocks
        ref = refs[node.input[0]]
        new = _replace_gather(node, ref, weights, quantize)
        if new is None:
            continue
        replaced[node.name] = new[0]
        inits += [out.put(t) for t in new[1]]
        readers[node.input[0]] -= 1
        if len(ref.shape) == 3:
            experts["experts_quantized"] += 1
            gathered.add(new[2])
            experts["experts"] = ", ".join(sorted(gathered)) + ": gathered from its blocks"
        else:
            embedding = new[2]
        del new
        release_memory()
        progress()
    for name, ref in refs.items():                # then the weights read as they are, in graph order
        if readers.get(name, 0):
            w = weights.get(ref.key, _TORCH[ref.dtype])
            inits.append(out.put_tensor(name, w.T if ref.transposed else w, ref.dtype))
            del w
            release_memory()
            progress()
        elif not any(name == n.input[1] for n in matmuls if n.name in replaced) and \
                not any(name == n.input[0] for n in gathers if n.name in replaced):
            progress()                            # a placeholder nothing reads
    nodes = [new for node in g.node for new in replaced.get(node.name, [node])]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(inits)
    if (counts or embedding != "dense" or experts["experts_quantized"]) and \
            not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    keep = [o for o in proto.opset_import if o.domain != "trtspec"]    # the fused experts' own domain: replaced
    del proto.opset_import[:]
    proto.opset_import.extend(keep)
    return {"matmuls_quantized": sum(counts.values()), "matmuls_total": len(matmuls), "block_types": counts,
            "joined_products": joined, "embedding": embedding, **(experts if experts["experts_total"] else {})}


def _replace_gather(node, ref: Ref, weights, quantize: str):
    """(nodes, initializers, block type) gathering an embedding [V, K] or stacked experts [E, N, K]
    (`quantize: gguf`) from the source's own blocks, or None to keep the Gather."""
    from .gguf_blocks import gather_nodes
    found = weights.blocks(ref.key)
    if found is None:
        return None
    nodes, inits = gather_nodes(f"{found[0]}/{node.name}", node.input[1], node.output[0], found[1],
                                ref.shape[:-1], ids_rank=2 if len(ref.shape) == 2 else 1)   # [B, T] or [B*T*k]
    return nodes, inits, weights.qtype_name(ref.key)


def _groups(matmuls: list, refs: dict[str, Ref], weights, quantize: str) -> list[list]:
    """The MatMuls to replace, one group per product: the MatMuls that read the same input (q/k/v,
    gate/up; with `quantize: gguf`, those whose weights have the same block type) are one group, which
    becomes one MatMulNBits over the joined weights, split after: fewer, larger products per layer,
    the same output columns. A group keeps the place of its first MatMul."""
    groups: dict[tuple, list] = {}
    for n in matmuls:
        key = refs[n.input[1]].key
        kind = (n.name,) if key == "model.embed_tokens.weight" else \
            (n.input[0], weights.qtype_name(key) if quantize == "gguf" else quantize)
        groups.setdefault(kind, []).append(n)
    return list(groups.values())


def _replace(group: list, refs: dict[str, Ref], weights, quantize: str, level: int):
    """(nodes, initializers, kind) computing the group's MatMuls from a quantized form of their
    weights, or None to keep them. A LM head tied to the embedding runs from the source's blocks of
    the embedding where it stores them (`quantize: gguf`: the weights the embedding is gathered from,
    bit for bit, instead of a dense fp32 copy of the whole table read every step); with int4 / int8
    it stays dense, as the embedding's Gather reads it."""
    node, keys = group[0], [refs[n.input[1]].key for n in group]
    if keys[0] == "model.embed_tokens.weight" and quantize != "gguf":
        return None
    x, ys = node.input[0], [n.output[0] for n in group]
    if quantize == "gguf":
        from .gguf_blocks import joined_matmul_nodes, matmul_nodes
        found = [weights.blocks(k) for k in keys]          # one block type: all None or none
        if found[0] is None:
            return None
        names = [f"{tname}/{n.name}" for (tname, _), n in zip(found, group)]
        if len(group) == 1:
            nodes, inits = matmul_nodes(names[0], x, ys[0], found[0][1], level)
        else:
            nodes, inits = joined_matmul_nodes(names, x, ys, [bl for _, bl in found], level)
        return nodes, inits, weights.qtype_name(keys[0])
    from .quantize import quantize_matmul
    parts = [weights.get(k, torch.float32) for k in keys]
    one = type(node).FromString(node.SerializeToString())
    if len(group) > 1:
        one.output[0] = f"{node.name}/joined"
    new = quantize_matmul(one, torch.cat(parts).T.numpy(), int(quantize[3:]), level)
    del parts
    if new is None or len(group) == 1:
        return None if new is None else (*new, quantize)
    nodes, inits = new
    sizes = np.array([refs[n.input[1]].shape[1] for n in group], dtype=np.int64)
    inits.append(numpy_helper.from_array(sizes, f"{node.name}/sizes"))
    nodes.append(helper.make_node("Split", [one.output[0], f"{node.name}/sizes"], ys, axis=-1,
                                  name=f"{node.name}/split"))
    return nodes, inits, quantize


_TORCH = {TensorProto.FLOAT: torch.float32, TensorProto.FLOAT16: torch.float16,
          TensorProto.BFLOAT16: torch.bfloat16, TensorProto.DOUBLE: torch.float64}


def _itemsize(dtype: int) -> int:
    return _TORCH[dtype].itemsize if dtype in _TORCH else 8


def release_memory(collect: bool = False) -> None:
    """Give freed memory back to the system between a build's tensors and stages: glibc keeps the
    freed heap pages of large arrays, which would add to the next tensor's resident peak."""
    import ctypes
    import gc
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass                                    # not glibc: nothing to trim


def export_graph_bytes(spec: dict, dtype: str, exact: bool | str, opset: int,
                       fused: tuple[str, ...] = ()) -> tuple[bytes, dict[str, Ref]]:
    """export_graph as a worker process returns it (the weightless graph is a few MB): the build
    exports a draft's graph in another process while it writes the target's."""
    from ..export.spec import DTYPES
    graph, refs = export_graph(ModelSpec.from_dict(spec), DTYPES[dtype], exact, opset, fused=fused)
    return graph.SerializeToString(), refs


def build_graph(weights, path: Path, dtype: torch.dtype, exact: bool | str = False, opset: int = 18,
                quantize: str = "none", accuracy_level: int = 1, desc: str | None = None,
                exported: tuple[bytes, dict[str, Ref]] | None = None, head: np.ndarray | None = None,
                hidden: bool = False) -> dict:
    """export_graph + write_graph: `weights` (engines/weights.py) as a step graph at `path` (with the
    hidden rows when `hidden`), with a progress bar per tensor when `desc` is given; `exported`:
    export_graph_bytes' answer for it."""
    from tqdm import tqdm
    if exported is None:
        graph, refs = export_graph(weights.spec, dtype, exact, opset, hidden, fused_ops(weights.spec, quantize))
    else:
        graph, refs = onnx.ModelProto.FromString(exported[0]), exported[1]
    with tqdm(total=len(refs) + (head is not None), desc=desc, unit="tensor", leave=False, disable=desc is None) as bar:
        return write_graph(graph, refs, weights, Path(path), quantize, accuracy_level, bar.update, head)
