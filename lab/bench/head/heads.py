"""Can a head drafting from the target's hidden rows pay on this CPU? An offline measurement (issue 42,
deliverable 3's trained head; issue 40's drafts at a tenth of a step), not a product path yet.

1. `collect`: the target of a folder built with `target.hidden_rows: true` prefills files of Python's
   standard library (the corpus the draft head's vocabulary is counted on; engines/head_vocab.py),
   64 tokens per call, keeping each row's hidden state and the target's own greedy next token.
2. `train`: Medusa-1 heads (Cai et al. 2024): head k maps row t to h + SiLU(W h + b), read by the
   target's own LM head (frozen, restricted to the draft head's 32,768 tokens), trained to give the
   target's greedy token k steps after the next one (self-distillation: what greedy acceptance needs).
3. Reports, on files held out from training: the top-1 agreement of each head with the target where
   the target's own greedy path led there (what a verified chain would accept), and a head's
   forward time on this CPU beside the target's step.

    python heads.py collect FOLDER rows.pt --tokens 30000
    python heads.py train FOLDER rows.pt heads.pt --heads 2 --epochs 4
    python heads.py draft FOLDER rows.pt        # the draft model's agreement on the same held-out files
    python heads.py export FOLDER heads.pt medusa.safetensors   # a head file for `heads:` (export/head.py)
"""
from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

CHUNK = 64          # tokens per prefill call (the runtime's PREFILL_CHUNK)
DOC = 512           # tokens kept per file
HELD_OUT = 0.1      # the share of files kept for evaluation


def collect(folder: str, out: str, tokens: int) -> None:
    from pathlib import Path
    folder = Path(folder)
    from trtspec.assembly.load import load_role, load_tokenizer, open_folder
    from trtspec.engines.head_vocab import corpus
    from trtspec.runtime.effects import drive
    from trtspec.runtime.runner import ModelRunner
    torch.set_num_threads(2)
    manifest, cfg, backend = open_folder(folder)
    engine = load_role(folder, "target", manifest, cfg, backend, threads=2)
    assert engine.hidden_rows, f"{folder}: build it with target.hidden_rows: true"
    tok = load_tokenizer(folder, manifest)
    files = corpus()
    random.Random(0).shuffle(files)
    runner = ModelRunner.alone(engine, capacity=DOC + 64)
    docs, n, t0 = [], 0, time.time()
    for f in files:
        ids = tok(f.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)["input_ids"][:DOC]
        if len(ids) < 4 * CHUNK:
            continue
        runner.reset()
        hidden, greedy = [], []
        for i in range(0, len(ids), CHUNK):
            part = ids[i:i + CHUNK]
            logits, rows = drive(runner.extend(part, last_only=False, hidden=True))
            runner.cache.commit(range(len(part)))
            hidden.append(rows.to(torch.float16).clone())
            greedy.append(logits.argmax(-1).clone())
        docs.append({"file": str(f), "ids": torch.tensor(ids), "hidden": torch.cat(hidden),
                     "greedy": torch.cat(greedy)})
        n += len(ids)
        print(f"{len(docs)} files, {n} tokens, {n / (time.time() - t0):.1f} tokens/s", flush=True)
        if n >= tokens:
            break
    torch.save(docs, out)


def examples(docs: list[dict], k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rows, labels, on_path) for head k: row t, the target's greedy token k steps after the next
    (greedy[t + k]), and whether the file's tokens t+1..t+k are the target's own greedy choices (so
    a drafted chain would have reached that position)."""
    rows, labels, on = [], [], []
    for d in docs:
        x, g, h = d["ids"], d["greedy"], d["hidden"]
        n = len(x) - k - 1
        if n <= 0:
            continue
        rows.append(h[:n])
        labels.append(g[k:k + n])
        ok = torch.ones(n, dtype=torch.bool)
        for j in range(1, k + 1):           # x[t + j] == greedy[t + j - 1]
            ok &= x[j:j + n] == g[j - 1:j - 1 + n]
        on.append(ok)
    return torch.cat(rows), torch.cat(labels), torch.cat(on)


class Head(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)
        torch.nn.init.zeros_(self.lin.weight)
        torch.nn.init.zeros_(self.lin.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.nn.functional.silu(self.lin(h))


def lm_head(folder: str):
    """The target's own LM head (dequantized from its source), restricted to the draft head's tokens."""
    from trtspec.assembly.load import load_tokenizer, open_folder
    from trtspec.assembly.sources import open_source
    from trtspec.engines.head_vocab import head_tokens
    manifest, cfg, _ = open_folder(folder)
    weights = open_source(cfg.target, "target")
    name = "lm_head.weight" if "lm_head.weight" in weights.shapes else "model.embed_tokens.weight"
    full = weights.get(name, torch.float32)
    keep = torch.from_numpy(head_tokens(load_tokenizer(folder, manifest), 32768, weights.spec.vocab_size))
    return full[keep].contiguous(), keep, name


def train(folder: str, rows_path: str, out: str, heads: int, epochs: int, lr: float) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    docs = torch.load(rows_path)
    cut = int(len(docs) * (1 - HELD_OUT))
    train_docs, test_docs = docs[:cut], docs[cut:]
    head_w, keep, name = lm_head(folder)
    index = torch.full((int(keep.max()) + 1,), -100, dtype=torch.int64)
    index[keep] = torch.arange(len(keep))
    reindex = lambda y: torch.where(y <= keep.max(), index[y.clamp(max=int(keep.max()))], -100)  # noqa: E731
    report = {"lm_head": name, "train_files": len(train_docs), "test_files": len(test_docs)}
    saved = {}
    for k in range(1, heads + 1):
        xs, ys, _ = examples(train_docs, k)
        xt, yt, on = examples(test_docs, k)
        ys, yt = reindex(ys), reindex(yt)
        head = Head(xs.shape[1])
        opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
        for epoch in range(epochs):
            t0, order, total = time.time(), torch.randperm(len(xs)), 0.0
            for i in range(0, len(xs), 256):
                b = order[i:i + 256]
                loss = torch.nn.functional.cross_entropy(head(xs[b].float()) @ head_w.T, ys[b], ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item() * len(b)
            acc, acc_on = accuracy(head, head_w, xt, yt, on)
            print(f"head {k} epoch {epoch + 1}: train loss {total / len(xs):.3f}, held-out top-1 {acc:.3f}, "
                  f"on the greedy path {acc_on:.3f} ({int(on.sum())} of {len(on)} rows), "
                  f"{time.time() - t0:.0f} s", flush=True)
        report[f"head{k}"] = {"rows": len(xs), "test_rows": len(xt), "on_path": int(on.sum()),
                              "top1": acc, "top1_on_path": acc_on}
        saved[f"head{k}"] = head.state_dict()
    # The LM head re-applied (k = 0 of the same scheme) names the next token: the rows are right.
    x0, y0, on0 = examples(test_docs, 0)
    report["lm_head_reapplied_top1"] = accuracy(torch.nn.Identity(), head_w, x0, reindex(y0), on0)[0]
    report["head_forward_ms"] = forward_ms(Head(head_w.shape[1]), head_w)
    print(report)
    torch.save({"heads": saved, "keep": keep, "report": report}, out)


@torch.no_grad()
def accuracy(head, head_w, x, y, on) -> tuple[float, float]:
    pred = torch.cat([(head(x[i:i + 1024].float()) @ head_w.T).argmax(-1) for i in range(0, len(x), 1024)])
    hit = pred == y
    return round(float(hit.float().mean()), 4), round(float(hit[on].float().mean()), 4)


@torch.no_grad()
def forward_ms(head, head_w, repeats: int = 50) -> float:
    h = torch.randn(1, head_w.shape[1])
    for _ in range(5):
        (head(h) @ head_w.T).argmax(-1)
    t0 = time.perf_counter()
    for _ in range(repeats):
        (head(h) @ head_w.T).argmax(-1)
    return round((time.perf_counter() - t0) / repeats * 1e3, 3)


def draft_agreement(folder: str, rows_path: str) -> dict:
    """The draft model's top-1 agreement with the target's greedy token on the held-out files (what a
    drafted chain's first token is accepted at), for comparison with head 1's."""
    from pathlib import Path

    from trtspec.assembly.load import load_role, open_folder
    from trtspec.runtime.effects import drive
    from trtspec.runtime.runner import ModelRunner
    torch.set_num_threads(2)
    folder = Path(folder)
    docs = torch.load(rows_path)
    test_docs = docs[int(len(docs) * (1 - HELD_OUT)):]
    manifest, cfg, backend = open_folder(folder)
    draft = load_role(folder, "draft", manifest, cfg, backend, threads=2)
    runner = ModelRunner.alone(draft, capacity=DOC + 64)
    hits = total = 0
    t0 = time.time()
    for d in test_docs:
        ids = d["ids"].tolist()
        runner.reset()
        guess = []
        for i in range(0, len(ids), CHUNK):
            part = ids[i:i + CHUNK]
            guess.append(drive(runner.extend(part, last_only=False)).argmax(-1).clone())
            runner.cache.commit(range(len(part)))
        hit = torch.cat(guess) == d["greedy"]
        hits, total = hits + int(hit.sum()), total + len(hit)
    out = {"draft_top1": round(hits / total, 4), "rows": total, "seconds": round(time.time() - t0, 1)}
    print(out)
    return out


def export(folder: str, heads_path: str, out: str) -> None:
    """The trained heads as a head role's file (export/head.py): their blocks, the target's LM head
    rows they were trained under, and those rows' token ids."""
    from safetensors.torch import save_file
    saved = torch.load(heads_path)
    head_w, keep, _ = lm_head(folder)
    assert torch.equal(keep, saved["keep"]), "the folder's head vocabulary is not the one the heads were trained on"
    state = {"lm_head.weight": head_w, "ids": keep.long()}
    for k in range(1, len(saved["heads"]) + 1):
        lin = saved["heads"][f"head{k}"]
        state[f"blocks.{k - 1}.weight"], state[f"blocks.{k - 1}.bias"] = lin["lin.weight"], lin["lin.bias"]
    save_file({k: v.contiguous() for k, v in state.items()}, out)
    print(f"{out}: {len(saved['heads'])} heads over {len(keep)} tokens")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("folder")
    c.add_argument("out")
    c.add_argument("--tokens", type=int, default=30000)
    t = sub.add_parser("train")
    t.add_argument("folder")
    t.add_argument("rows")
    t.add_argument("out")
    t.add_argument("--heads", type=int, default=2)
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--lr", type=float, default=1e-3)
    d = sub.add_parser("draft")
    d.add_argument("folder")
    d.add_argument("rows")
    e = sub.add_parser("export")
    e.add_argument("folder")
    e.add_argument("heads")
    e.add_argument("out")
    a = p.parse_args()
    if a.cmd == "collect":
        collect(a.folder, a.out, a.tokens)
    elif a.cmd == "train":
        train(a.folder, a.rows, a.out, a.heads, a.epochs, a.lr)
    elif a.cmd == "export":
        export(a.folder, a.heads, a.out)
    else:
        draft_agreement(a.folder, a.rows)
