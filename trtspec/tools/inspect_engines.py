"""`trtspec inspect`: what an engine folder holds, and whether its backends agree.

`--compare` runs one identical step (a prefilled cache, then a random token tree) through every
backend that can run here, via the shared Engine interface, and reports the largest logit
difference and argmax agreement against the torch engine (the folder's weights, or for an ONNX
Runtime / TensorRT folder the model rebuilt from the config's source; for a quantized folder that
difference is the quantization's, reported, not judged). It also checks each backend's batch
invariance: every tree node's logits against the same path fed one token per forward, as `ar`
would (lossless greedy needs the two to pick the same argmax); `--trees N` does that bit for bit
over N random trees at cached lengths up to 2,000 (`--longest`) on the folder's own backend (`sweep`). Where
TensorRT and polygraphy both exist, polygraphy's Comparator also checks the ONNX graph under
TensorRT vs ONNX Runtime (not exercised in CI: neither can be installed there).
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ..assembly.backends import LoadOptions
from ..assembly.config import Config
from ..assembly.load import load_engine, torch_model
from ..engines.manifest import is_head, verify
from ..engines.tensorrt_build import tensorrt_unavailable_reason
from ..engines.torch_engine import TorchEngine
from ..export.model import LOGICAL_CHUNK
from ..runtime.effects import drive
from ..runtime.runner import ModelRunner
from ..runtime.tree import TokenTree


def describe(folder: Path) -> list[str]:
    from ..assembly.backends import returns_hidden
    m = verify(folder)
    rev = m.get("graph_revision", 1)
    lines = [f"engine folder {folder} (contract v{m['contract_version']}, graph revision {rev}, built {m['created']}, "
             "hashes OK)",
             "versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)]
    for role, info in m["models"].items():
        s = info["spec"]
        if is_head(info):
            lines.append(f"{role}: {info['source']} · a {s['kind']} head role: {s['depth']} tokens ahead, from the "
                         f"target's {s['hidden_size']}-wide hidden rows, over {s['rows']} tokens · {info['dtype']}")
        else:
            lines.append(f"{role}: {info['source']} · {s['arch']} {s['num_layers']} layers, hidden "
                         f"{s['hidden_size']}, heads {s['num_heads']}/{s['num_kv_heads']}, vocab {s['vocab_size']} · "
                         f"{info['dtype']}")
        for name, rel in info["artifacts"].items():
            size = sum(m["files"][f]["bytes"] for f in (rel, rel + ".data") if f in m["files"]) / 2**20
            lines.append(f"  {name:<10} {rel} ({size:.1f} MiB{' with its .data' if rel + '.data' in m['files'] else ''})")
        if q := info.get("quantize"):
            lines.append(f"  quantized  {q['mode']} weight-only: {q['op']}, block {q['block_size']}, "
                         f"{'symmetric' if q['symmetric'] else 'zero points'}, accuracy level {q['accuracy_level']} "
                         f"({q['activations']} activations), "
                         f"{q['matmuls_quantized']} of {q['matmuls_total']} MatMuls ({q['quantizer']})")
            if types := q.get("block_types"):
                lines.append("  blocks     " + ", ".join(f"{k} x{n}" for k, n in sorted(types.items())))
            if q.get("joined_products") or q.get("embedding", "dense") != "dense":
                lines.append(f"  products   {q.get('joined_products', 0)} joined (weights of one input as one product); "
                             f"embedding {q.get('embedding', 'dense')}"
                             + (" (gathered from its blocks)" if q.get("embedding", "dense") != "dense" else ""))
            if q.get("experts_total"):
                lines.append(f"  experts    {q['experts_quantized']} of {q['experts_total']} expert weights quantized"
                             + (f" ({q['experts']})" if q.get("experts") else " (fp32, gathered per row)"))
        if head := info.get("head"):
            lines.append(f"  LM head    {head['tokens']} of {head['of']} tokens ({head['chosen_by']}); the others "
                         "get probability 0 in drafts")
        if returns_hidden(info):
            lines.append(f"  hidden     the step also returns the {s['hidden_size']}-wide rows its LM head reads "
                         "(contract v4, for a drafting head)")
        if info.get("attention") == "fp64":
            lines.append("  attention  fp64, KV cache fp64 (exact attention: a tree row's logits are the one-token "
                         "forward's; check: inspect --compare --trees N)")
        elif info.get("attention") == "logical":
            lines.append(f"  attention  by logical order, in chunks of {LOGICAL_CHUNK} keys, KV cache in the model's dtype "
                         "(exact attention: a tree row's logits are the one-token forward's; check: inspect --compare "
                         "--trees N)")
    from ..runtime.costs import load
    costs = load(folder)
    lines += costs.describe() if costs else [f"step costs: none stored (measured at the first budget: auto request; "
                                             f"now: trtspec inspect --engines {folder} --measure-costs)"]
    return lines


def random_step(spec_vocab: int, n_prompt: int = 24, n_tree: int = 9, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, spec_vocab, (n_prompt,), generator=gen).tolist()
    parents = _random_parents(gen, n_tree)
    tree = TokenTree(torch.randint(0, spec_vocab, (n_tree,), generator=gen), parents)
    return prompt, tree


def _random_parents(gen: torch.Generator, n: int) -> list[int]:
    """A random single-root tree in topological order: node i hangs off one of nodes 0..i-1."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def compare(folder: Path, role: str = "target", atol_scale: float = 1e-3) -> list[str]:
    m = verify(folder)
    cfg = Config.from_dict(m["config"])
    info = m["models"][role]
    prompt, tree = random_step(info["spec"]["vocab_size"])
    backends = ["torch", "onnxruntime"] + ([] if tensorrt_unavailable_reason() else ["tensorrt"])
    results, lines = {}, []
    for backend in backends:
        try:
            if backend == "torch":                # the reference: the folder's weights, or the source's
                engine = TorchEngine(torch_model(folder, role, info, m["config"]))
            else:
                engine = load_engine(folder, role, info, backend, LoadOptions(threads=cfg.threads))
        except Exception as e:                    # a backend that cannot run this folder here
            lines.append(f"{backend:<12} skipped: {e}")
            continue
        try:
            runner = ModelRunner.alone(engine, capacity=len(prompt) + len(tree) + 8)
            drive(runner.prefill(prompt))
            results[backend] = drive(runner.verify(tree)).float().clone()
            lines.append(f"{backend:<12} " + _invariance(runner, tree, results[backend]))
        finally:
            engine.close()
    ref = results.get("torch")
    quant = info.get("quantize", {}).get("mode")
    for backend, logits in results.items():
        if backend == "torch" or ref is None:
            continue
        diff = float((logits - ref).abs().max())
        scale = float(ref.abs().max())
        agree = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        ok = (f"{quant} weights: differs from fp32 by design" if quant else
              "OK" if diff <= atol_scale * scale else "MISMATCH")
        lines.append(f"{backend:<12} vs torch: max |Δlogit| {diff:.3g} (scale {scale:.3g}), argmax agreement "
                     f"{agree:.0%} over {len(tree)} tree nodes — {ok}")
    lines += _polygraphy(folder, info)
    return lines


SWEEP_LONGEST = 2000  # the longest cached length a sweep draws trees at, unless asked (`inspect --longest`)


def sweep(folder: Path, role: str = "target", trees: int = 1000, seed: int = 0,
          longest: int | None = None) -> list[str]:
    """`count_differences` on the folder's own backend (`inspect --compare --trees N`)."""
    longest = longest or SWEEP_LONGEST
    m = verify(folder)
    cfg = Config.from_dict(m["config"])
    info = m["models"][role]
    asked, longest = longest, max(17, min(longest, cfg.max_seq_len - TREE_ROOM))
    engine = load_engine(folder, role, info, m["backend"], LoadOptions(threads=cfg.threads))
    try:
        differ, nodes, worst, _ = count_differences(engine, info["spec"]["vocab_size"], trees, longest, seed,
                                                 progress=f"{role}: trees vs one token per forward")
    finally:
        engine.close()
    verdict = "bit-identical" if differ == 0 else f"max |Δlogit| {worst:.3g} — NOT EXACT"
    capped = f" (capped at max_seq_len {cfg.max_seq_len} - {TREE_ROOM})" if longest < asked else ""
    return [f"{m['backend']:<12} exactness: {trees} random trees ({nodes} nodes) at cached lengths 16-{longest}"
            f"{capped}: {differ} of {nodes} nodes' logits differ from one token per forward — {verdict}"]


TREE_ROOM = 24       # rows a sweep's cache holds beyond its longest cached length (a tree, and margin)


def count_differences(engine, vocab: int, trees: int, longest: int, seed: int = 0,
                      progress: str | None = None, buckets: dict | None = None,
                      until: float | None = None) -> tuple[int, int, float, int]:
    """Exactness at scale: `trees` random trees (2-16 nodes) at random cached lengths (16 to
    `longest`), each node's logits against the same path fed one token per forward, compared bit
    for bit; returns (nodes that differ, nodes, largest |Δlogit|, trees run). One long random prompt is
    prefilled once; trees run from the longest cached length down, so a tree's rows never overwrite
    a later tree's prefix, and paths are replayed depth first, one forward per node. `buckets`: the
    Batcher's (padded step shapes; a cache bucket covers `longest + TREE_ROOM`). `until`: a
    time.monotonic() deadline after which no further tree is started (the counts cover those run)."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(seed)
    plan = []
    for _ in range(trees):
        n = int(torch.randint(2, 17, (1,), generator=gen))
        parents = _random_parents(gen, n)
        plan.append((int(torch.randint(16, longest + 1, (1,), generator=gen)),
                     TokenTree(torch.randint(0, vocab, (n,), generator=gen), parents)))
    plan.sort(key=lambda p: -p[0])
    runner = ModelRunner.alone(engine, capacity=longest + TREE_ROOM, buckets=buckets)
    drive(runner.prefill(torch.randint(0, vocab, (longest,), generator=gen).tolist()))
    differ = nodes = run = 0
    worst = 0.0
    for length, tree in tqdm(plan, desc=progress, unit="tree", disable=progress is None):
        if until is not None and time.monotonic() > until:
            break
        run += 1
        runner.cache.rewind(length, 0)
        tree_logits = drive(runner.verify(tree)).float().clone()
        for node, row in _one_token_rows(runner, tree, length):
            d = float((row - tree_logits[node]).abs().max())
            worst, differ, nodes = max(worst, d), differ + (d > 0), nodes + 1
    return differ, nodes, worst, run


def _one_token_rows(runner: ModelRunner, tree: TokenTree, length: int):
    """(node, logits) for every node of `tree` with its path fed one token per forward after `length`
    committed rows (what `ar` computes): depth first, so each node costs one forward over the rows its
    ancestors just wrote. A row is valid until the next forward."""
    for node in _preorder(tree):
        runner.cache.rewind(length, int(tree.host_depth[node]))
        logits = drive(runner.extend([int(tree.host_tokens[node])]))
        yield node, logits.reshape(-1, logits.shape[-1])[-1].float()


def _preorder(tree: TokenTree) -> list[int]:
    kids, out, stack = tree.children(), [], [0]
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(reversed(kids[node]))
    return out


def _invariance(runner: ModelRunner, tree: TokenTree, tree_logits: torch.Tensor) -> str:
    """Each node's row of a tree forward vs its path fed one token per forward (what `ar` computes)."""
    worst, same = 0.0, 0
    for node, row in _one_token_rows(runner, tree, runner.cache.length):
        worst = max(worst, float((row - tree_logits[node]).abs().max()))
        same += int(row.argmax() == tree_logits[node].argmax())
    runner.cache.rollback()
    verdict = "bit-identical" if worst == 0 else f"max |Δlogit| {worst:.3g}"
    return (f"batch invariance, tree rows vs one token per forward: {verdict}, argmax agreement "
            f"{same}/{len(tree)} — {'OK' if same == len(tree) else 'ARGMAX DIFFERS'}")


def _polygraphy(folder: Path, info: dict) -> list[str]:
    reason = tensorrt_unavailable_reason()
    if reason:
        return [f"polygraphy TensorRT-vs-ONNX Runtime check skipped: {reason}"]
    try:
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner
        from polygraphy.comparator import Comparator
    except ImportError:
        return ["polygraphy not installed: pip install polygraphy (trtspec[tensorrt])"]
    arts = info["artifacts"]
    onnx_key = next((k for k in arts if k.startswith("onnx_")), None)
    plan_key = next((k for k in arts if k.startswith("plan_")), None)
    if not (onnx_key and plan_key):
        return ["polygraphy check skipped: the folder has no ONNX + TensorRT plan pair"]
    runners = [OnnxrtRunner(SessionFromOnnx(str(folder / arts[onnx_key]))),
               TrtRunner(EngineFromBytes((folder / arts[plan_key]).read_bytes()))]
    results = Comparator.run(runners)
    ok = bool(Comparator.compare_accuracy(results))
    return [f"polygraphy TensorRT vs ONNX Runtime: {'OK' if ok else 'MISMATCH'}"]
