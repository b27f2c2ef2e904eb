"""TokenTree: the drafted tokens one target step verifies, plus their vectorized bookkeeping.

Node 0 is the root: the last emitted token, whose KV is not cached yet. Nodes are stored in
topological order (parent index < child index), so a root-to-node path is ascending, which is what
`KVCache.commit` wants. A chain (classic speculative decoding) is a tree with one child per node.

`q[i]` is the distribution node i's token was drawn from, when it was sampled; `None` (or a row of
NaN) marks a deterministic child (argmax / top-k / n-gram / merged), verified with q = one-hot.

Strategies build a tree on the host; `tree.to(device)` puts it where the target runs with one copy
of (tokens, parents, depth), and the ancestor mask is computed there from the parents, with no
read back (verification lays out a phase's trees' children on the host: verify._forest). The
host keeps its own copy of the tokens and parents, so `path()`, `children()` and the emitted
tokens never read the device.
"""
from __future__ import annotations

import numpy as np
import torch


def _host(x) -> np.ndarray:
    """An int64 host copy (the caller's array may be reused)."""
    if isinstance(x, torch.Tensor):
        x = x.numpy(force=True)
    return np.array(x, dtype=np.int64)


class TokenTree:
    def __init__(self, tokens, parents, q: torch.Tensor | None = None, device: str | torch.device | None = None):
        self.host_tokens = _host(tokens)                               # [N]
        self.host_parents = _host(parents)                             # [N], -1 for the root
        n = len(self.host_parents)
        depth = np.zeros(n, dtype=np.int64)
        for i in range(1, n):                                          # topological: parents come first
            depth[i] = depth[self.host_parents[i]] + 1
        self.host_depth = depth
        self.device = torch.device(device if device is not None else (q.device if q is not None else "cpu"))
        packed = torch.from_numpy(np.stack([self.host_tokens, self.host_parents, depth])).to(self.device)
        self.tokens, self.parents, self.depth = packed[0], packed[1], packed[2]     # [N] int64 each
        self.q = None if q is None else q.to(self.device)                          # [N, V] or None
        self.ancestors = self._closure()          # [N, N] bool: [i, j] = j is i or an ancestor of i

    def _closure(self) -> torch.Tensor:
        """Ancestor-or-self mask by repeated squaring of (I + parent edges): after k squarings it holds
        every ancestor within 2^k steps, so ceil(log2(max depth)) rounds, a count the host knows."""
        n = len(self)
        a = torch.eye(n, device=self.device)
        child = torch.arange(1, n, device=self.device)
        a[child, self.parents[1:]] = 1.0
        for _ in range(max(int(self.host_depth.max(initial=0)) - 1, 0).bit_length()):
            a = (a @ a).clamp_(max=1.0)
        return a.bool()

    @classmethod
    def chain(cls, root: int, drafts: list[int], q: torch.Tensor | None = None) -> "TokenTree":
        n = len(drafts) + 1
        return cls([root] + list(drafts), np.arange(-1, n - 1), q)

    def to(self, device: str | torch.device) -> "TokenTree":
        """This tree on `device` (itself when it is there already)."""
        if torch.device(device) == self.device:
            return self
        return TokenTree(self.host_tokens, self.host_parents, self.q, device)

    def __len__(self) -> int:
        return len(self.host_parents)

    def children(self) -> list[list[int]]:
        """Child lists in node order (the order siblings are tried during sampling verification)."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for child, parent in enumerate(self.host_parents.tolist()):
            if parent >= 0:
                kids[parent].append(child)
        return kids

    def path(self, node: int) -> np.ndarray:
        """Node indices root..node, ascending (from the host's parents: no device read)."""
        out = [node]
        while self.host_parents[out[-1]] >= 0:
            out.append(int(self.host_parents[out[-1]]))
        return np.array(out[::-1], dtype=np.int64)
