"""Host reads of the verification rules before this change (7e8bd6c, read from git), counted with the
torch function mode the tests use (lab.host_reads). Run from the repository root:

    python lab/bench/device-verify/reads_before.py
"""
import subprocess

import torch

from lab.host_reads import HostReads


def load(path: str, namespace: dict) -> None:
    src = subprocess.run(["git", "show", f"7e8bd6c:{path}"], capture_output=True, text=True, check=True).stdout
    exec(compile(src.replace("from .tree import TokenTree", ""), path, "exec"), namespace)


def main() -> None:
    old = {"__name__": "old"}
    load("trtspec/runtime/tree.py", old)
    load("trtspec/runtime/verify.py", old)
    vocab, g = 32, torch.Generator().manual_seed(0)
    for kind, parents in (("chain", [-1, 0, 1, 2, 3]), ("tree", [-1, 0, 0, 0, 1, 1, 4])):
        n = len(parents)
        q = torch.softmax(torch.randn(n, vocab, generator=g), -1)
        q[0] = float("nan")
        tree = old["TokenTree"](torch.arange(n) + 1, torch.tensor(parents), q)
        logits = torch.randn(n, vocab, generator=g)
        with HostReads() as r:
            old["verify_greedy"](tree, logits)
        print(kind, "greedy", len(r.reads), r.reads)
        for seed in range(3):
            p = torch.softmax(torch.randn(n, vocab, generator=g), -1)
            with HostReads() as r:
                path, _ = old["verify_sampling"](tree, p, torch.Generator().manual_seed(seed))
            print(kind, "sampled, path", path.tolist(), len(r.reads), r.reads)


if __name__ == "__main__":
    main()
