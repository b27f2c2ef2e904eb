"""Host reads of the verification rules before this change (7e8bd6c, read from git), counted with the
same torch function mode as tests/test_verify.py.  Run from the repository root:

    python docs/bench/device-verify/reads_before.py
"""
import subprocess, sys, torch
sys.path.insert(0, "tests")
from test_verify import HostReads
def load(path, ns):
    src = subprocess.run(["git", "show", f"7e8bd6c:{path}"], capture_output=True, text=True, check=True).stdout
    src = src.replace("from .tree import TokenTree", "")
    exec(compile(src, path, "exec"), ns)
ns = {"__name__": "old"}
load("trtspec/runtime/tree.py", ns)
load("trtspec/runtime/verify.py", ns)
T = ns["TokenTree"]
V = 32
g = torch.Generator().manual_seed(0)
for kind in ("chain", "tree"):
    parents = [-1, 0, 1, 2, 3] if kind == "chain" else [-1, 0, 0, 0, 1, 1, 4]
    n = len(parents)
    toks = torch.arange(n) + 1
    q = torch.softmax(torch.randn(n, V, generator=g), -1); q[0] = float("nan")
    t = T(toks, torch.tensor(parents), q)
    logits = torch.randn(n, V, generator=g)
    with HostReads() as r:
        ns["verify_greedy"](t, logits)
    print(kind, "greedy", r.reads)
    for s in range(3):
        p = torch.softmax(torch.randn(n, V, generator=g), -1)
        with HostReads() as r:
            path, nxt = ns["verify_sampling"](t, p, torch.Generator().manual_seed(s))
        print(kind, "sampled path", path.tolist(), len(r.reads), r.reads)
