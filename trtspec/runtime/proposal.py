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
- `source`: which drafter proposed each node, as indices into SOURCES (None: the draft model, or
  no node at all). The step reports the mix (`sources`: proposed and accepted nodes per drafter)
  and budget: auto calibrates each drafter's scores apart (`node_q()` holds the draft's
  probability for a model node, the empirical probability for a suffix node).
- `nodes`: per-node flags kept with a recorded tree (`--show-tree`); `stats`: the step's
  strategy-specific numbers; `path_flags`: per-node flags reported as whether the accepted path
  has one (e.g. `merged_path`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .tree import TokenTree

# Who proposed a node: the draft model; a suffix trie (suffix.py); a cheap chain the draft reviewed
# and kept (staged's stage 2, cascade's MaG: valued by the draft's probabilities); the n-gram copy
# (the `ngram` strategy's unreviewed chain).
SOURCES = ("draft", "suffix", "review", "ngram")
DRAFT, SUFFIX, REVIEW, NGRAM = range(len(SOURCES))


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
    source: np.ndarray | None = None

    def sources(self, path: np.ndarray) -> dict[str, list[int]]:
        """{drafter: [nodes proposed, nodes accepted]} of this tree (root excluded), once `path` is known."""
        if len(self.tree) < 2:
            return {}
        src = np.zeros(len(self.tree), dtype=np.int64) if self.source is None else np.asarray(self.source)
        proposed = np.bincount(src[1:], minlength=len(SOURCES))
        accepted = np.bincount(src[path[1:]], minlength=len(SOURCES))
        return {name: [int(proposed[i]), int(accepted[i])] for i, name in enumerate(SOURCES) if proposed[i]}

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
