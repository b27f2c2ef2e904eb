"""(Historical: measures the recursive-rejection walk that keyed draws replaced in 75a40c6; run it
from a checkout before that commit, as its results in docs/benchmarks.md were.)
CPU time of the sampling verification walk at the Qwen vocabulary (V = 151,936), before and after
it moved to the device: the host walk of 7e8bd6c (a host read per child tried) vs `sampling_choice`
as the CPU runs it (early exit) and as a GPU runs it (every trial, masked, no read).

    python lab/bench/device-verify/verify_cost.py [--repeats 15]

The old walk is read from git (7e8bd6c:trtspec/runtime/verify.py), so run it inside the repository.
"""
from __future__ import annotations

import argparse
import subprocess
import time

import numpy as np
import torch

from trtspec.runtime.tree import TokenTree
from trtspec.runtime.verify import sampling_choice

V = 151_936


def old_walk():
    src = subprocess.run(["git", "show", "7e8bd6c:trtspec/runtime/verify.py"], capture_output=True, text=True,
                         check=True).stdout.replace("from .tree import TokenTree", "")
    namespace = {"__name__": "old_verify", "TokenTree": TokenTree}
    exec(compile(src, "7e8bd6c:verify.py", "exec"), namespace)
    return namespace["verify_sampling"]


def tree(n: int, kind: str, rng: np.random.Generator) -> TokenTree:
    parents = list(range(-1, n - 1)) if kind == "chain" else [-1] + [int(rng.integers(max(0, i - 4), i))
                                                                     for i in range(1, n)]
    q = None
    if kind != "deterministic":
        q = torch.softmax(torch.randn(n, V) * 2, -1)
        q[0] = float("nan")
    return TokenTree(rng.integers(0, V, n), parents, q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    walks = {"host walk (7e8bd6c)": old_walk(),
             "device walk, early exit (CPU)": lambda t, p, g: sampling_choice(t, p, g, early_exit=True),
             "device walk, every trial (GPU)": lambda t, p, g: sampling_choice(t, p, g, early_exit=False)}
    print(f"{'tree':<22} {'walk':<32} {'median ms':>9}")
    for kind, n in [("chain", 9), ("deterministic", 24), ("sampled", 24)]:
        t = tree(n, kind, rng)
        p = torch.softmax(torch.randn(n, V) * 2, -1)
        times = {name: [] for name in walks}
        for _ in range(args.repeats):               # interleaved, so host noise hits every walk alike
            for name, walk in walks.items():
                g = torch.Generator().manual_seed(0)
                t0 = time.perf_counter()
                walk(t, p, g)
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            print(f"{kind + f' ({n} nodes)':<22} {name:<32} {np.median(ts) * 1e3:>9.2f}")


if __name__ == "__main__":
    main()
