"""Timing-only variants of an engine folder's target graph, to split a one-token step's time.

    python lab/bench/kernels/variants.py FOLDER OUT

writes, next to a hard link of the folder's weights file (ONNX Runtime refuses symbolic links):
- OUT/products.onnx: every MatMulNBits of the graph, each on its own input row (K wide);
- OUT/offsets.onnx: every Q4_K offsets' product (the `gguf/.../min` MatMuls) on its block sums;
- OUT/no-offsets/: an engine folder whose target skips the offsets' products (its numbers are wrong;
  `python -m lab.stepcost --engines FOLDER --against OUT/no-offsets` times it).
Then `python lab/bench/kernels/time_graphs.py OUT/products.onnx OUT/offsets.onnx`.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import onnx
from onnx import TensorProto, helper


def _save(m: onnx.ModelProto, nodes: list, inputs: list, out: Path) -> None:
    used = {i for n in nodes for i in n.input}
    graph = helper.make_graph(nodes, out.stem, inputs,
                              [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes],
                              [t for t in m.graph.initializer if t.name in used])
    onnx.save(helper.make_model(graph, opset_imports=m.opset_import, ir_version=m.ir_version), out)


def _k(node) -> int:
    return next(a.i for a in node.attribute if a.name == "K")


def main(folder: Path, out: Path) -> None:
    graph = next((folder / "target").glob("*.onnx"))
    m = onnx.load(graph, load_external_data=False)
    data = graph.with_name(graph.name + ".data")
    created = not out.exists()
    (out / "no-offsets" / "target").mkdir(parents=True, exist_ok=True)
    for where in (out, out / "no-offsets" / "target"):
        if not (where / data.name).exists():
            try:
                os.link(data, where / data.name)
            except OSError as e:
                if created:                     # nothing left behind
                    shutil.rmtree(out)
                sys.exit(f"variants.py: cannot hard-link {data} into {where} ({e.strerror}); "
                         "put OUT on the same file system as FOLDER")

    products = [copy.deepcopy(n) for n in m.graph.node if n.op_type == "MatMulNBits"]
    for n in products:
        n.input[0] = f"x{_k(n)}"
    widths = sorted({_k(n) for n in products})
    _save(m, products, [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, k]) for k in widths],
          out / "products.onnx")

    inits = {t.name: t for t in m.graph.initializer}
    offsets = [copy.deepcopy(n) for n in m.graph.node if n.op_type == "MatMul" and n.name.endswith("/min")]
    for n in offsets:
        n.input[0] = f"s{inits[n.input[1]].dims[0]}"
    widths = sorted({inits[n.input[1]].dims[0] for n in offsets})
    _save(m, offsets, [helper.make_tensor_value_info(f"s{k}", TensorProto.FLOAT, [1, k]) for k in widths],
          out / "offsets.onnx")

    drop = set()
    for n in m.graph.node:                  # y = Add(product, min) -> Identity(product)
        if n.op_type == "Add" and n.name.startswith("gguf/") and n.input[1].endswith("/min"):
            p = n.input[1][:-len("min")]
            drop |= {p + "xb", p + "xsum", p + "min"}
            n.op_type = "Identity"
            del n.input[1]
    keep = [n for n in m.graph.node if n.name not in drop]
    used = {i for n in keep for i in n.input}
    inits_kept = [t for t in m.graph.initializer if t.name in used]
    del m.graph.node[:], m.graph.initializer[:]
    m.graph.node.extend(keep)
    m.graph.initializer.extend(inits_kept)
    target = out / "no-offsets" / "target" / graph.name
    onnx.save(m, target)
    for f in folder.iterdir():              # the rest of the folder, as links; the manifest re-signed
        if f.name not in ("target", "manifest.json") and not f.name.startswith(".") \
                and not (out / "no-offsets" / f.name).exists():
            (out / "no-offsets" / f.name).symlink_to(f.resolve())
    manifest = json.loads((folder / "manifest.json").read_text())
    body = target.read_bytes()
    for v in manifest.values():
        if isinstance(v, dict) and f"target/{graph.name}" in v:
            v[f"target/{graph.name}"] = {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    (out / "no-offsets" / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"{len(products)} products, {len(offsets)} offsets' products, {len(drop)} nodes dropped -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
