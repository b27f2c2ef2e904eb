"""Proposal: what a strategy hands the shared step (step.py). A strategy only proposes; it never
verifies or commits.

- `tree`: the TokenTree the target verifies (node 0: the root, the last emitted token; each node's
  q row where its token was sampled).
- `draft_rows`: for each tree node, the draft scratch row (relative to the draft's committed length)
  holding its KV computed under its own prefix, -1 where there is none (never fed, or reached
  through a merged GSD edge); rows [0, `draft_kept`) are the pending tokens fed with the root,
  always kept. The step commits those plus the rows along the accepted path up to its first -1.
  `None`: the strategy has no draft model (or did not draft): the draft cache is left as it is.
- `node_q()`: each node's draft probability given its parent (NaN: none), computed only when a
  budget calibrates on it (budget: auto).
- `nodes`: per-node flags kept with a recorded tree (`--show-tree`); `stats`: the step's
  strategy-specific numbers; `path_flags`: per-node flags reported as whether the accepted path
  has one (e.g. `merged_path`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .tree import TokenTree


@dataclass
class Proposal:
    tree: TokenTree
    draft_rows: np.ndarray | None = None
    draft_kept: int = 0
    draft_forwards: int = 0
    node_q: Callable[[], np.ndarray] | None = None
    nodes: dict[str, list] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)
    path_flags: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def root(cls, root: int) -> "Proposal":
        """The root alone: a plain ar step."""
        return cls(TokenTree.chain(root, []))

    def draft_commit(self, path: np.ndarray) -> list[int]:
        """The draft scratch rows to keep once `path` (tree node indices, root first) is accepted."""
        rows = list(range(self.draft_kept))
        for node in path[1:].tolist():
            if self.draft_rows[node] < 0:
                break
            rows.append(int(self.draft_rows[node]))
        return rows
