"""What a tree costs in a mixture-of-experts layer (issue 64): one MoE layer of a real model's shape
(default Qwen3-30B-A3B's: hidden 2,048, 128 experts, 8 per token, 768 wide; random fp32 weights) on
the CPU, a forward of T rows (T = 1, 2, 4, 8, 16) whose rows route to the same experts (T copies of
one token) or to different ones (T random tokens), in three forms:

  ours-ort    the export model's `MoE` (export/model.py) as torch.onnx exports it, on ONNX Runtime:
              each row gathers its own k experts' weights and multiplies them alone (row-exact: a
              row's result never depends on the other rows), so T rows read T x k experts whether
              they share them or not;
  ours-qmoe   the experts as a `quantize: int4` build writes them (engines/qmoe.py): ONNX Runtime's
              quantized MoE kernel (com.microsoft.QMoE, int4 blocks of 32, int8 activations), one
              row per call (a Scan over the rows), so a row's arithmetic is the same alone or not;
  ours-gbq    a form tried and left (int4 by ONNX Runtime's Gather quantizer): each Gather of
              stacked experts as com.microsoft.GatherBlockQuantized, which dequantizes a row's k
              experts to fp32 before the same products;
  ours-torch  the same module in torch eager;
  grouped     transformers' own Qwen3MoeExperts on the same weights (torch eager): each expert the
              rows picked runs once over its rows, so T rows read the distinct experts they picked.

Row-exactness is measured too: a token's output alone and among 1, 3, 7 and 15 others, bit for bit.
(ONNX Runtime's fused com.microsoft.MoE CPU kernel is not a form here: its SwiGLU is gpt-oss's,
gate * sigmoid(1.702 gate) * (up + 1), not Qwen3's silu(gate) * up, and it takes no third weight.)

    python -m lab.moe_tree_cost [--experts 128] [--top-k 8] [--hidden 2048] [--inter 768]
                                [--threads 2] [--repeat 7] [--forms ours-ort,ours-qmoe,...]
                                [--out docs/bench/moe-tree-cost]

Writes moe.json and moe.md (medians in ms per forward) to --out; prints the table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from trtspec.export.model import MoE
from trtspec.export.spec import ModelSpec


def spec_of(a) -> ModelSpec:
    return ModelSpec(arch="qwen3_moe", vocab_size=16, hidden_size=a.hidden, intermediate_size=a.inter, num_layers=1,
                     num_heads=1, num_kv_heads=1, head_dim=a.hidden, num_experts=a.experts, experts_per_token=a.top_k,
                     moe_intermediate_size=a.inter, norm_topk_prob=True)


def session(path: Path, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def export_ours(moe: MoE, folder: Path) -> Path:
    path = folder / "ours.onnx"
    x = torch.randn(1, 4, moe.gate.in_features)
    with torch.no_grad():
        torch.onnx.export(moe, (x,), str(path), dynamo=True, opset_version=18, input_names=["x"], output_names=["y"],
                          dynamic_shapes={"x": {1: torch.export.Dim("rows")}}, external_data=True)
    return path


def gathered_int4(path: Path) -> Path:
    """ours-gbq: the exported graph with every Gather of stacked experts quantized by ONNX Runtime's
    own Gather quantizer (4-bit blocks of 32 along K, GatherBlockQuantized)."""
    import onnx
    from onnx import helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    m = onnx.load(str(path))
    m.opset_import[0].version = 21                   # 4-bit initializers
    q = MatMulNBitsQuantizer(m, bits=4, block_size=32, is_symmetric=False, op_types_to_quantize=("Gather",),
                             quant_axes=(("Gather", 2),))
    q.process()
    out = path.with_name("gbq.onnx")
    if not any(o.domain == "com.microsoft" for o in q.model.model.opset_import):
        q.model.model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save(q.model.model, str(out), save_as_external_data=True, location="gbq.onnx.data")
    return out


def qmoe(moe: MoE, spec: ModelSpec, folder: Path) -> Path:
    """ours-qmoe: the module exported with its experts as one node, replaced as a `quantize: int4`
    build replaces it (engines/qmoe.py), at int8 activations (accuracy level 4)."""
    import onnx

    from trtspec.engines.qmoe import experts_nodes, is_experts
    from trtspec.export.experts_op import TRANSLATION

    class Source:                                    # the checkpoint's names, as engines/weights.py serves them
        def get(self, key, dtype):
            return getattr(moe.experts, key.rsplit(".", 1)[1]).detach().to(dtype)

    moe.fused = True
    try:
        x = torch.randn(1, 4, moe.gate.in_features)
        with torch.no_grad():
            program = torch.onnx.export(moe, (x,), dynamo=True, opset_version=18, input_names=["x"], output_names=["y"],
                                        dynamic_shapes={"x": {1: torch.export.Dim("rows")}},
                                        custom_translation_table=TRANSLATION)
    finally:
        moe.fused = False
    m = program.model_proto
    node = next(n for n in m.graph.node if is_experts(n))
    nodes, inits = experts_nodes(node, Source(), spec, 4)
    at = list(m.graph.node).index(node)
    m.graph.node.remove(node)
    for i, n in enumerate(nodes):
        m.graph.node.insert(at + i, n)
    m.graph.initializer.extend(inits)
    keep = [o for o in m.opset_import if o.domain != "trtspec"] + [onnx.helper.make_opsetid("com.microsoft", 1)]
    del m.opset_import[:]
    m.opset_import.extend(keep)
    out = folder / "qmoe.onnx"
    onnx.save(m, str(out), save_as_external_data=True, location="qmoe.onnx.data")
    return out


def grouped(moe: MoE, a):
    """transformers' Qwen3MoeExperts holding the same weights (gate and up stacked as it keeps them)."""
    import transformers
    cfg = transformers.Qwen3MoeConfig(hidden_size=a.hidden, moe_intermediate_size=a.inter, num_experts=a.experts,
                                      num_experts_per_tok=a.top_k, norm_topk_prob=True)
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    e = moe.experts
    experts.gate_up_proj = torch.nn.Parameter(torch.cat([e.gate_proj, e.up_proj], 1).detach())
    experts.down_proj = torch.nn.Parameter(e.down_proj.detach().clone())
    return experts.eval()


EVICT = np.zeros(64 << 20, np.float32)              # 256 MB written between calls: each call reads its experts cold,
                                                    # as in a model whose other layers ran in between


def timed(fn, repeat: int) -> float:
    fn()                                            # warm-up
    times = []
    for _ in range(repeat):
        np.add(EVICT, 1.0, out=EVICT)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--forms", default="ours-ort,ours-qmoe,ours-gbq,ours-torch,grouped", help="comma-separated forms to run")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    moe = MoE(spec_of(a)).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    rows = {"same": torch.randn(1, a.hidden).repeat(16, 1), "different": torch.randn(16, a.hidden)}
    results, check = [], {}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        want = a.forms.split(",")
        exported = export_ours(moe, Path(tmp))
        ours, theirs = session(exported, a.threads), grouped(moe, a)
        fused = session(qmoe(moe, spec_of(a), Path(tmp)), a.threads) if "ours-qmoe" in want else None
        gbq = session(gathered_int4(exported), a.threads) if "ours-gbq" in want else None
        torch.set_num_threads(a.threads)

        def route(x):
            w, idx = torch.topk(torch.softmax(moe.gate(x).float(), -1), a.top_k, -1)
            return idx, (w / w.sum(-1, keepdim=True)).to(x.dtype)

        forms = {"ours-ort": lambda x: ours.run(None, {"x": x[None].numpy()})[0][0],
                 "ours-qmoe": lambda x: fused.run(None, {"x": x[None].numpy()})[0][0],
                 "ours-gbq": lambda x: gbq.run(None, {"x": x[None].numpy()})[0][0],
                 "ours-torch": lambda x: moe(x[None])[0].numpy(),
                 "grouped": lambda x: theirs(x, *route(x)).numpy()}
        forms = {k: f for k, f in forms.items() if k in want}
        ref = moe(rows["different"][None])[0].numpy()
        for name, f in forms.items():
            full = f(rows["different"])
            alone = [f(rows["different"][:t])[0] for t in (1, 2, 4, 8)]
            check[name] = {"max_abs_vs_ours_torch": float(np.abs(full - ref).max()), "scale": float(np.abs(ref).max()),
                           "row_alone_equals_row_among_others": all(bool((r == full[0]).all()) for r in alone)}
            for kind in ("same", "different"):
                for t in (1, 2, 4, 8, 16):
                    ms = timed(lambda: f(rows[kind][:t]), a.repeat)
                    results.append({"form": name, "routing": kind, "rows": t, "ms": round(ms, 2)})
                    print(f"{name:10s} {kind:9s} T={t:2d} {ms:8.2f} ms", flush=True)
    base = {r["form"]: r["ms"] for r in results if r["rows"] == 1 and r["routing"] == "different"}
    lines = ["| form | routing | T=1 | T=2 | T=4 | T=8 | T=16 | T=16 / T=1 |", "|---|---|---|---|---|---|---|---|"]
    for form in forms:
        for kind in ("same", "different"):
            ms = [r["ms"] for r in results if r["form"] == form and r["routing"] == kind]
            lines.append(f"| {form} | {kind} | " + " | ".join(f"{m:.1f}" for m in ms) + f" | {ms[-1] / base[form]:.1f}x |")
    table = "\n".join(lines)
    print(table)
    print(json.dumps(check, indent=1))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "moe.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "results": results,
                                                    "check": check}, indent=1))
        (a.out / "moe.md").write_text(table + "\n\n```\n" + json.dumps(check, indent=1) + "\n```\n")


if __name__ == "__main__":
    main()
