"""TokenTree: the drafted tokens one target step verifies, plus their vectorized bookkeeping.

Node 0 is the root: the last emitted token, whose KV is not cached yet. Nodes are stored in
topological order (parent index < child index), so a root-to-node path is ascending, which is what
`KVCache.commit` wants. A chain (classic speculative decoding) is a tree with one child per node.

`q[i]` is the distribution node i's token was drawn from, when it was sampled; `None` (or a row of
NaN) marks a deterministic child (argmax / top-k / n-gram / merged), verified with q = one-hot.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TokenTree:
    tokens: torch.Tensor                 # [N] int64
    parents: torch.Tensor                # [N] int64, -1 for the root
    q: torch.Tensor | None = None        # [N, V] float32 proposal rows, NaN row = deterministic
    depth: torch.Tensor = field(init=False)
    ancestors: torch.Tensor = field(init=False)   # [N, N] bool: [i, j] = j is i or an ancestor of i

    def __post_init__(self) -> None:
        n = self.tokens.shape[0]
        # Pointer jumping: one vectorized pass per tree level instead of a walk per node.
        anc = torch.eye(n, dtype=torch.bool)
        depth = torch.zeros(n, dtype=torch.int64)
        rows = torch.arange(n)
        ptr = self.parents.clone()
        while bool((ptr >= 0).any()):
            live = ptr >= 0
            anc[rows[live], ptr[live]] = True
            depth += live.long()
            ptr = torch.where(live, self.parents[ptr.clamp(min=0)], ptr)
        self.depth, self.ancestors = depth, anc

    @classmethod
    def chain(cls, root: int, drafts: list[int], q: torch.Tensor | None = None) -> "TokenTree":
        n = len(drafts) + 1
        return cls(torch.tensor([root] + list(drafts), dtype=torch.int64), torch.arange(-1, n - 1), q)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def children(self) -> list[list[int]]:
        """Child lists in node order (the order siblings are tried during sampling verification)."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for child, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                kids[parent].append(child)
        return kids

    def path(self, node: int) -> torch.Tensor:
        """Node indices root..node, ascending."""
        return self.ancestors[node].nonzero().flatten()
