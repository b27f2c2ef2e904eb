"""Exact tree attention without fp64 on ONNX Runtime's CPU kernels: candidate forms, measured (issue 62).

One attention layer of the default target's shape (Qwen2.5-1.5B: 12 query heads over 2 KV heads,
head dim 128; fp32 keys and values), a committed prefix of C rows and a random tree of T nodes after
it. A tree node is exact when its output equals, bit for bit, the output of the same token decoded
alone after its path (a one-row step whose keys are the prefix, the node's ancestors in depth order
and itself), through the same form. Forms (each an ONNX graph of standard ops):

  physical-fp32   today's layout without fp64: every row scores all rows as they lie (prefix, then
                  the step's rows in the tree's order), masked; softmax; one product with V;
  physical-fp64   the same in float64, rounded to fp32 after (today's exact setting);
  logical-chunks  each row's keys gathered in logical order (prefix, ancestors by depth, itself),
                  padded to a whole number of chunks of K keys; per (row, head, chunk) a product of
                  one query row (batched, never flattened into one matrix), the chunk's max, its
                  exp-sum and its product with V; the chunks combined over the chunk axis (max, then
                  running sums (CumSum) weighted by exp(m_c - m)); empty chunks contribute exact
                  zeros, so a row padded to more chunks (a step with longer rows) keeps its value -
                  if the kernels keep their order, which is what is measured. (ReduceSum over the
                  chunks does not: it regroups by the chunk count, 5 of 568 rows off in the
                  product's layout; export/model.py Attention.logical is this form.)

    python -m lab.exact_attention_cpu [--cached 16,256,2048,8000] [--nodes 16] [--trees 20]
                                      [--chunk 64] [--threads 2] [--out docs/bench/exact-attention-cpu]

Prints and writes (--out) per form and cached length: tree nodes differing from the same token
alone, and the median ms of one layer's attention at T = 1 and T = nodes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

H, HKV, D = 12, 2, 128
G = H // HKV


def _model(nodes, inputs, inits=(), dtype=TensorProto.FLOAT):
    g = helper.make_graph(nodes, "attn", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def physical(dtype: str):
    """q [T, H, D], k/v [HKV, N, D] (the rows as they lie), mask [T, N] bool -> y [T, H, D]."""
    f = TensorProto.DOUBLE if dtype == "fp64" else TensorProto.FLOAT
    c = [numpy_helper.from_array(np.array([-1, HKV, G, D], np.int64), "qs"),
         numpy_helper.from_array(np.array(-np.inf, np.float64 if f == TensorProto.DOUBLE else np.float32), "ninf"),
         numpy_helper.from_array(np.array([-1, H, D], np.int64), "ys"),
         numpy_helper.from_array(np.array(D ** -0.5, np.float64 if f == TensorProto.DOUBLE else np.float32), "scale")]
    n = [helper.make_node("Cast", ["q"], ["qc"], to=f), helper.make_node("Cast", ["k"], ["kc"], to=f),
         helper.make_node("Cast", ["v"], ["vc"], to=f),
         helper.make_node("Reshape", ["qc", "qs"], ["q4"]),                     # [T, HKV, G, D]
         helper.make_node("Transpose", ["q4"], ["qt"], perm=[1, 0, 2, 3]),      # [HKV, T, G, D]
         helper.make_node("Transpose", ["kc"], ["kt"], perm=[0, 2, 1]),         # [HKV, D, N]
         helper.make_node("Unsqueeze", ["kt", "ax1"], ["k4"]),                  # [HKV, 1, D, N]
         helper.make_node("MatMul", ["qt", "k4"], ["s0"]),                      # [HKV, T, G, N]
         helper.make_node("Mul", ["s0", "scale"], ["s"]),
         helper.make_node("Unsqueeze", ["mask", "ax1"], ["m3"]),                # [T, 1, N]
         helper.make_node("Where", ["m3", "s", "ninf"], ["sm"]),
         helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
         helper.make_node("Unsqueeze", ["vc", "ax1"], ["v4"]),                  # [HKV, 1, N, D]
         helper.make_node("MatMul", ["p", "v4"], ["o"]),                        # [HKV, T, G, D]
         helper.make_node("Transpose", ["o"], ["ot"], perm=[1, 0, 2, 3]),
         helper.make_node("Reshape", ["ot", "ys"], ["yd"]),
         helper.make_node("Cast", ["yd"], ["y"], to=TensorProto.FLOAT)]
    c += [numpy_helper.from_array(np.array([1], np.int64), "ax1")]
    ins = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [None, H, D]),
           helper.make_tensor_value_info("k", TensorProto.FLOAT, [HKV, None, D]),
           helper.make_tensor_value_info("v", TensorProto.FLOAT, [HKV, None, D]),
           helper.make_tensor_value_info("mask", TensorProto.BOOL, [None, None])]
    return _model(n, ins, c)


def logical(chunk: int):
    """q [T, H, D], k/v [HKV, N, D], idx [T, L] (each row's keys in logical order, L a multiple of
    `chunk`, padded with any row), valid [T, L] bool -> y [T, H, D]."""
    c = [numpy_helper.from_array(np.array(D ** -0.5, np.float32), "scale"),
         numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
         numpy_helper.from_array(np.array(0, np.float32), "zero"),
         numpy_helper.from_array(np.array([0, 0, -1, chunk, D], np.int64), "kcs"),      # [HKV, T, nC, K, D]
         numpy_helper.from_array(np.array([-1], np.int64), "last"),
         numpy_helper.from_array(np.array([2], np.int64), "ax2"),
         numpy_helper.from_array(np.array([-1, HKV, G, D], np.int64), "qs"),
         numpy_helper.from_array(np.array([-1, H, D], np.int64), "ys"),
         numpy_helper.from_array(np.array([0, -1, chunk], np.int64), "vcs"),
         numpy_helper.from_array(np.array(2, np.int64), "two"), numpy_helper.from_array(np.array(-1, np.int64), "minus1")]
    n = [helper.make_node("Gather", ["k", "idx"], ["kg"], axis=1),                  # [HKV, T, L, D]
         helper.make_node("Gather", ["v", "idx"], ["vg"], axis=1),
         helper.make_node("Reshape", ["kg", "kcs"], ["kc"]),                        # [HKV, T, nC, K, D]
         helper.make_node("Reshape", ["vg", "kcs"], ["vc"]),
         helper.make_node("Reshape", ["q", "qs"], ["q4"]),                          # [T, HKV, G, D]
         helper.make_node("Transpose", ["q4"], ["qt"], perm=[1, 0, 2, 3]),          # [HKV, T, G, D]
         helper.make_node("Unsqueeze", ["qt", "ax2"], ["q5"]),                      # [HKV, T, 1, G, D]
         helper.make_node("Transpose", ["kc"], ["kct"], perm=[0, 1, 2, 4, 3]),      # [HKV, T, nC, D, K]
         helper.make_node("MatMul", ["q5", "kct"], ["s0"]),                         # [HKV, T, nC, G, K]
         helper.make_node("Mul", ["s0", "scale"], ["s"]),
         helper.make_node("Reshape", ["valid", "vcs"], ["vm"]),                     # [T, nC, K]
         helper.make_node("Unsqueeze", ["vm", "ax2"], ["vm4"]),                     # [T, nC, 1, K]
         helper.make_node("Where", ["vm4", "s", "ninf"], ["sm"]),
         helper.make_node("ReduceMax", ["sm", "last"], ["mc"], keepdims=1),         # [HKV, T, nC, G, 1]
         helper.make_node("Sub", ["sm", "mc"], ["d"]),
         helper.make_node("Exp", ["d"], ["e0"]),
         helper.make_node("Where", ["vm4", "e0", "zero"], ["e"]),                   # empty chunk: 0, not NaN
         helper.make_node("ReduceSum", ["e", "last"], ["lc"], keepdims=1),          # [HKV, T, nC, G, 1]
         helper.make_node("MatMul", ["e", "vc"], ["oc"]),                           # [HKV, T, nC, G, D]
         helper.make_node("ReduceMax", ["mc", "ax2"], ["m"], keepdims=1),           # [HKV, T, 1, G, 1]
         helper.make_node("Sub", ["mc", "m"], ["dm"]),
         helper.make_node("Exp", ["dm"], ["w0"]),
         helper.make_node("IsNaN", ["w0"], ["wn"]),
         helper.make_node("Where", ["wn", "zero", "w0"], ["w"]),                    # -inf - -inf chunks: 0
         helper.make_node("Mul", ["oc", "w"], ["ow"]), helper.make_node("Mul", ["lc", "w"], ["lw"]),
         # the chunks summed in order: a running sum, its last slot (ReduceSum regroups by the count)
         helper.make_node("CumSum", ["ow", "two"], ["oc2"]), helper.make_node("CumSum", ["lw", "two"], ["lc2"]),
         helper.make_node("Gather", ["oc2", "minus1"], ["os"], axis=2),             # [HKV, T, G, D]
         helper.make_node("Gather", ["lc2", "minus1"], ["ls"], axis=2),
         helper.make_node("Div", ["os", "ls"], ["o"]),
         helper.make_node("Transpose", ["o"], ["ot"], perm=[1, 0, 2, 3]),
         helper.make_node("Reshape", ["ot", "ys"], ["y"])]
    ins = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [None, H, D]),
           helper.make_tensor_value_info("k", TensorProto.FLOAT, [HKV, None, D]),
           helper.make_tensor_value_info("v", TensorProto.FLOAT, [HKV, None, D]),
           helper.make_tensor_value_info("idx", TensorProto.INT64, [None, None]),
           helper.make_tensor_value_info("valid", TensorProto.BOOL, [None, None])]
    return _model(n, ins, c)


def session(model, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def tree(rng, t: int) -> list[list[int]]:
    """Each node's path from the first node under the prefix to itself (parents random, topological)."""
    paths = []
    for i in range(t):
        parent = int(rng.integers(-1, i)) if i else -1
        paths.append((paths[parent] if parent >= 0 else []) + [i])
    return paths


def feeds(form: str, q, k, v, keys: list[list[int]], chunk: int) -> dict:
    """One step's inputs: `keys[i]` are row i's key rows in logical order (rows of k/v)."""
    n = k.shape[1]
    if form.startswith("physical"):
        mask = np.zeros((len(keys), n), bool)
        for i, ks in enumerate(keys):
            mask[i, ks] = True
        return {"q": q, "k": k, "v": v, "mask": mask}
    width = max(-(-len(ks) // chunk) * chunk for ks in keys)
    idx, valid = np.zeros((len(keys), width), np.int64), np.zeros((len(keys), width), bool)
    for i, ks in enumerate(keys):
        idx[i, :len(ks)], valid[i, :len(ks)] = ks, True
    return {"q": q, "k": k, "v": v, "idx": idx, "valid": valid}


def differing(sess, form: str, rng, cached: int, t: int, chunk: int) -> int:
    """Nodes of one random tree whose output differs from the same token decoded alone after its path."""
    k = rng.standard_normal((HKV, cached + t, D), dtype=np.float32)
    v = rng.standard_normal((HKV, cached + t, D), dtype=np.float32)
    q = rng.standard_normal((t, H, D), dtype=np.float32)
    paths = tree(rng, t)
    prefix = list(range(cached))
    y = sess.run(None, feeds(form, q, k, v, [prefix + [cached + a for a in p] for p in paths], chunk))[0]
    bad = 0
    for i, p in enumerate(paths):             # sequential decoding: the path's rows right after the prefix
        rows = prefix + [cached + a for a in p]
        ks, vs = k[:, rows], v[:, rows]
        alone = sess.run(None, feeds(form, q[i:i + 1], ks, vs, [list(range(len(rows)))], chunk))[0][0]
        bad += not np.array_equal(alone.view(np.uint32), y[i].view(np.uint32))
    return bad


def timed(sess, form: str, rng, cached: int, t: int, chunk: int, repeat: int = 7) -> float:
    k = rng.standard_normal((HKV, cached + t, D), dtype=np.float32)
    v = rng.standard_normal((HKV, cached + t, D), dtype=np.float32)
    q = rng.standard_normal((t, H, D), dtype=np.float32)
    f = feeds(form, q, k, v, [list(range(cached)) + [cached + a for a in p] for p in tree(rng, t)], chunk)
    sess.run(None, f)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sess.run(None, f)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", default="16,256,2048,8000")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--trees", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    forms = {"physical-fp32": physical("fp32"), "physical-fp64": physical("fp64"), "logical-chunks": logical(a.chunk)}
    rows = []
    for name, model in forms.items():
        sess = session(model, a.threads)
        for cached in (int(c) for c in a.cached.split(",")):
            rng = np.random.default_rng(cached)
            bad = sum(differing(sess, name, rng, cached, a.nodes, a.chunk) for _ in range(a.trees))
            one, many = (timed(sess, name, rng, cached, t, a.chunk) for t in (1, a.nodes))
            rows.append({"form": name, "cached": cached, "differing": bad, "nodes": a.trees * a.nodes,
                         "ms_T1": round(one, 3), f"ms_T{a.nodes}": round(many, 3)})
            print(f"{name:15s} cached {cached:5d}: {bad:4d} of {a.trees * a.nodes} nodes differ; "
                  f"{one:7.3f} ms at T=1, {many:7.3f} ms at T={a.nodes}", flush=True)
    lines = [f"| form | cached | nodes differing | ms, T=1 | ms, T={a.nodes} |", "|---|---|---|---|---|"]
    lines += [f"| {r['form']} | {r['cached']} | {r['differing']} of {r['nodes']} | {r['ms_T1']:.3f} | "
              f"{r[f'ms_T{a.nodes}']:.3f} |" for r in rows]
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "attention.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "results": rows},
                                                         indent=1))
        (a.out / "attention.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
