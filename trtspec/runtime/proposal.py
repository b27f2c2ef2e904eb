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
- `source`: which drafter proposed each node, as indices into SOURCES (`tag`; None: the draft
  model, or no node at all). The step reports the mix (`sources`: proposed and accepted nodes per
  drafter) and budget: auto calibrates each drafter's scores apart (`node_q()` holds the draft's
  probability for a model node, the drafter's own score for a scored drafter's node).
- what the nodes are worth and the step's draft forwards are not here: the step's ledger
  (budget/plan.py `Ledger`) holds them, which budget: auto sizes by and learns from.
- `nodes`: per-node flags kept with a recorded tree (`--show-tree`); `stats`: the step's
  strategy-specific numbers; `path_flags`: per-node flags reported as whether the accepted path
  has one (e.g. `merged_path`).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .tree import TokenTree

# Who proposed a node, by tag: the models' own first (the draft model; a cheap chain the draft
# reviewed and kept: staged's stage 2, cascade's reviews, valued by the draft's probabilities; a
# grammar that leaves one legal token: jump-forward, drafters/forced.py, added by the step and
# accepted whenever its parent is; its drafter's registry name is the same tag), then each drafter
# (drafters/) under its registry name, added as it is first used (`tag`). The step reports the mix
# by name (`sources`); the budget calibrates each drafter's scores apart (budget/values.py).
SOURCES: list[str] = ["draft", "review", "grammar"]
DRAFT, REVIEW, GRAMMAR = range(len(SOURCES))
_TAGS = threading.Lock()


def tag(name: str) -> int:
    """The source index of the drafter called `name` (added to SOURCES on first use)."""
    with _TAGS:
        if name not in SOURCES:
            SOURCES.append(name)
        return SOURCES.index(name)


@dataclass
class Proposal:
    tree: TokenTree
    draft_rows: np.ndarray | None = None
    draft_kept: int = 0
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
        names = list(SOURCES)
        proposed = np.bincount(src[1:], minlength=len(names))
        accepted = np.bincount(src[path[1:]], minlength=len(names))
        return {name: [int(proposed[i]), int(accepted[i])] for i, name in enumerate(names) if proposed[i]}

    @classmethod
    def root(cls, root: int) -> Proposal:
        """The root alone: a plain ar step."""
        return cls(TokenTree.chain(root, []))

    def subset(self, keep: np.ndarray) -> Proposal:
        """This proposal with only the nodes `keep` marks (a bool per node: the root and, for each kept
        node, its parent), renumbered in order. Dropping a sampled child leaves its later siblings' q
        rows as they were drawn from, so verification stays exact (step.py prunes what a grammar
        forbids this way)."""
        idx = np.flatnonzero(keep)
        new = np.full(len(keep), -1, dtype=np.int64)
        new[idx] = np.arange(len(idx))
        t = self.tree
        parents = np.where(t.host_parents[idx] >= 0, new[t.host_parents[idx].clip(min=0)], -1)
        q = None if t.q is None else t.q[torch.from_numpy(idx).to(t.q.device)]
        n = len(keep)
        node_q = None if self.node_q is None else (lambda f=self.node_q: np.asarray(f())[idx])
        return replace(
            self, tree=TokenTree(t.host_tokens[idx], parents, q, t.device),
            draft_rows=None if self.draft_rows is None else np.asarray(self.draft_rows)[idx], node_q=node_q,
            nodes={k: [v[i] for i in idx] if len(v) == n else v for k, v in self.nodes.items()},
            path_flags={k: np.asarray(v)[idx] for k, v in self.path_flags.items()},
            source=None if self.source is None else np.asarray(self.source)[idx],
            stats={**self.stats, "pruned": n - len(idx)})

    def extend(self, parents: list[int], tokens: list[int], source: int) -> "Proposal":
        """This proposal with deterministic nodes added after its own (parents: existing nodes or
        earlier added ones): q = one-hot, no draft row (the draft catches up on them later)."""
        t, n, k = self.tree, len(self.tree), len(tokens)
        q = None if t.q is None else torch.cat([t.q, torch.full((k, t.q.shape[1]), float("nan"), dtype=t.q.dtype,
                                                               device=t.q.device)])
        src = np.zeros(n, dtype=np.int64) if self.source is None else np.asarray(self.source, dtype=np.int64)
        nan = np.full(k, np.nan)
        node_q = None if self.node_q is None else (lambda f=self.node_q: np.concatenate([np.asarray(f()), nan]))
        return replace(
            self, tree=TokenTree(np.concatenate([t.host_tokens, tokens]), np.concatenate([t.host_parents, parents]),
                                 q, t.device),
            draft_rows=None if self.draft_rows is None else np.concatenate([self.draft_rows, np.full(k, -1)]),
            node_q=node_q, source=np.concatenate([src, np.full(k, source)]),
            nodes={key: list(v) + [False] * k if len(v) == n else v for key, v in self.nodes.items()},
            path_flags={key: np.concatenate([np.asarray(v), np.zeros(k, dtype=bool)]) for key, v in self.path_flags.items()},
            stats={**self.stats, "forced": k})

    def draft_commit(self, path: np.ndarray) -> list[int]:
        """The draft scratch rows to keep once `path` (tree node indices, root first) is accepted."""
        rows = list(range(self.draft_kept))
        for node in path[1:].tolist():
            if self.draft_rows[node] < 0:
                break
            rows.append(int(self.draft_rows[node]))
        return rows
