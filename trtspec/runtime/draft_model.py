"""The draft model as a part: `DraftModel`, which a strategy that runs it holds as `self.model`, and
`DraftTree`, a step's token tree grown by the draft inside its KV scratch.

Every strategy that runs a draft model (`needs_draft`: chain, staged, dyspec, gsd, cascade) reaches
it through `self.model` alone (no strategy touches the draft's runner, `st.draft`):

- `open(st, capacity, top_k)`: a step's tree grown by the draft (the draft catches up on the tokens
  it has not seen and runs on the root; then `tree.candidates(node, value)` are its valued children
  of a fed node, `tree.feed(nodes, chains)` feeds a frontier and reviews the free drafters' chains in
  the same forward, and `tree.proposal()` hands the tree and its draft KV rows to the shared step,
  which commits the accepted path's);
- `extend(st, tokens)` and `catch_up(st)`: a chain's forwards, one token at a time (`chain`).

A step's draft forwards are counted in one place, the step's ledger (`st.ledger.forwards`, the rows
of each): whoever runs a forward of the step appends it there; the budget plans on it and the step
reports its length. A catch-up (the draft prefilling what it missed during ar steps) is no forward of
the step's tree: it is not in the ledger, for chain and tree strategies alike.

It is not a drafter (drafters/ has the free and head ones, which cost no draft forward): its nodes
are tagged `draft` (proposal.DRAFT), and the free drafters' chains it reviews `review`. Per-request
state (the draft's KV, its scratch rows) lives in the request's slot and DecodeState, never here.

DraftTree (shared by staged, dyspec, gsd, cascade). Node 0 is the root (the last emitted token). A
node is *fed* once the draft has run on its token: its KV row sits in the draft scratch and
`probs[node]` (the draft's distribution over its children) is known. Many nodes are fed in one
batched draft forward; each sees the committed prefix, the pending chain, and its own ancestors.

Every method that runs the draft is a coroutine of model calls (`yield from tree.feed(...)`, see
effects.py), so the draft calls of many requests can share one batched forward.

`feed(nodes, chains=...)` also lets a cheaper drafter's chain be *reviewed* by the draft in the same
forward (staged speculation / vertical cascade): chain tokens are fed speculatively and kept only
while each equals the draft's own argmax at its parent (or passes a lenience test); the rest are
marked dead and never reach the target.

Each draft forward ends with one host read (`effects.read`: the scheduler reads every request's of
a draft round in one transfer): every fed node's top-k (`top[node]`: probabilities and
tokens, k = the strategy's `top_k`, at least the argmax) and each reviewed chain token's probability
at its parent. Strategies rank, review and value children from these host copies (`prob(parent,
token)`), so drafting reads the device once per forward, not once per candidate.

`proposal(nodes)` hands the tree to the shared step (step.py) with each node's draft KV row: after
verification the step keeps the rows of the accepted path (only nodes fed under their true prefix:
a node reached through a merged GSD edge borrowed another prefix's KV, so the commit stops there
and the next step re-feeds those tokens as pending).
"""
from __future__ import annotations

import numpy as np
import torch

from .decode import DecodeState
from .effects import Calls, read
from .proposal import DRAFT, REVIEW, Proposal
from .tree import TokenTree


class DraftModel:
    """The draft model, as the strategies that run it reach it (stateless: what a request's draft
    holds lives in its DecodeState)."""

    def open(self, st: DecodeState, capacity: int = 512, top_k: int = 1) -> Calls:
        """A step's tree rooted at the last emitted token (a coroutine: `tree = yield from model.open(st)`)."""
        return (yield from DraftTree.open(st, capacity, top_k))

    def catch_up(self, st: DecodeState) -> Calls:
        """Prefill what the draft lacks beyond its usual lag (after ar steps), as DraftTree.open does."""
        yield from st.draft_catch_up()

    def extend(self, st: DecodeState, tokens: list[int]) -> Calls:
        """The draft's logits after `tokens`, appended to its scratch (one forward, recorded in the
        step's ledger)."""
        logits = yield from st.draft.extend(tokens)
        st.ledger.forwards.append(len(tokens))
        return logits


class DraftTree:
    def __init__(self, st: DecodeState, capacity: int = 512, top_k: int = 1):
        self.st = st
        self.top_k = max(1, top_k)
        self.runner = st.draft
        cache = self.runner.cache
        self.pending = st.pending()                               # tokens the draft has not seen, root last
        self.base_pos = cache.length + len(self.pending) - 1      # position of the root
        n = capacity
        self.tokens = np.zeros(n, dtype=np.int64)
        self.parents = np.full(n, -1, dtype=np.int64)
        self.depth = np.zeros(n, dtype=np.int64)
        self.row = np.full(n, -1, dtype=np.int64)                 # draft scratch row of a fed node
        self.alive = np.ones(n, dtype=bool)                       # False: rejected in a review
        self.borrowed = np.zeros(n, dtype=bool)                   # reached through a merged edge
        self.score = np.full(n, np.nan)                           # a scored drafter's candidate: its score
        self.source = np.full(n, DRAFT, dtype=np.int64)           # who proposed the node (proposal.SOURCES)
        self.anc = np.zeros((n, n), dtype=bool)                   # ancestor-or-self
        self.q: list[torch.Tensor | None] = [None] * n            # proposal dist a sampled child came from
        self.probs: dict[int, torch.Tensor] = {}                  # on the draft's device
        self.top: dict[int, tuple[list[float], list[int]]] = {}   # host: a fed node's top-k (probs, tokens)
        self._known: dict[tuple[int, int], float] = {}            # host: (parent, token) -> probability
        self.size = 1
        self.tokens[0] = st.root
        self.anc[0, 0] = True
        self.row_owner: list[int] = [0] * len(self.pending)       # pending rows are the root's prefix
        self.forward_rows = st.ledger.forwards                     # rows of each draft forward: the step's ledger
        self.reviewed = 0                                          # chain tokens offered for review
        self.review_kept = 0                                       # ... and kept by the draft

    @classmethod
    def open(cls, st: DecodeState, capacity: int = 512, top_k: int = 1) -> Calls:
        """A tree rooted at the last emitted token, whose distribution the draft computes by feeding
        the pending tokens (a coroutine: `tree = yield from DraftTree.open(st, n)`). `top_k`: how
        many of each fed node's most likely children the strategy ranks (read with the forward)."""
        yield from st.draft_catch_up()
        tree = cls(st, capacity, top_k)
        logits = yield from tree.runner.extend(tree.pending)      # feeds the root
        tree.forward_rows.append(len(tree.pending))
        tree.row[0] = len(tree.pending) - 1
        dists = tree._dist(logits, [0])
        tree.probs[0] = dists[0]
        yield from tree._read(dists, [0], [])
        return tree

    # -- structure ---------------------------------------------------------------------------
    def add(self, parent: int, token: int, q: torch.Tensor | None = None, borrowed: bool = False,
            score: float = np.nan, source: int = DRAFT) -> int:
        """A node under `parent`. `source`: who proposed it, if not the draft model (a drafter's tag,
        drafters/), with its `score` if the drafter scores its candidates; unfed until a forward
        feeds it, like any node."""
        n = self.size
        if n >= len(self.tokens):
            raise RuntimeError("draft tree capacity exceeded; lower the tree budget")
        self.size += 1
        self.tokens[n], self.parents[n], self.depth[n] = token, parent, self.depth[parent] + 1
        self.anc[n] = self.anc[parent]
        self.anc[n, n] = True
        self.q[n] = q
        self.score[n] = score
        self.source[n] = source
        self.borrowed[n] = borrowed or self.borrowed[parent]
        return n

    @property
    def from_review(self) -> np.ndarray:
        """Per node: proposed by a cheaper drafter and reviewed by the draft."""
        return self.source == REVIEW

    def cut(self, node: int) -> None:
        """Drop `node` and its subtree from the tree the target will see."""
        self.alive[node:self.size] &= ~self.anc[node:self.size, node]

    def children(self, node: int) -> np.ndarray:
        kids = np.flatnonzero(self.parents[: self.size] == node)
        return kids[self.alive[kids]]

    def fed(self, node: int) -> bool:
        return self.row[node] >= 0

    def candidates(self, node: int, value: float) -> list[tuple[float, int, float]]:
        """The draft model's candidates under the fed `node` (worth `value`): its top-k children as
        (value, token, probability), best first, each valued by the request's Values (the draft's
        calibration) and the top-1 seen by it. Read with the forward that fed the node: no device read."""
        values = self.st.values
        probs, toks = self.top[node]
        values.saw_top1(probs[0])
        return [(values.child(value, p), t, p) for p, t in zip(probs, toks)]

    def prob(self, parent: int, token: int) -> float:
        """The draft's probability of `token` after the fed node `parent`: from the host copies read
        with the forward (a top-k token, a reviewed one), else one read of its own."""
        probs, toks = self.top[parent]
        if token in toks:
            return probs[toks.index(token)]
        if (parent, token) not in self._known:
            self._known[parent, token] = float(self.probs[parent][token])
        return self._known[parent, token]

    # -- draft forwards ----------------------------------------------------------------------
    def path(self, node: int) -> np.ndarray:
        """The tokens from the root down to `node` (ancestors come first: they have smaller indices)."""
        return self.tokens[: self.size][self.anc[node, : self.size]]

    def _dist(self, logits: torch.Tensor, nodes: list[int]) -> torch.Tensor:
        """Draft distribution used to rank and draw children of `nodes` (one logits row each): the
        sampling transform when the target samples (the exact q that sampled children come from),
        plain softmax for greedy runs; with a grammar, what it forbids after each node is masked."""
        if self.st.grammar is not None:
            logits = self.st.constrain(logits, [self.path(n)[1:].tolist() for n in nodes])
        if self.st.sampling.greedy:
            return torch.softmax(logits.float(), -1)
        return self.st.draft_probs(logits)

    def feed(self, nodes: list[int], chains: dict[int, list[int]] | None = None,
             lenience: float = 1.0) -> Calls:
        """One batched draft forward over `nodes` (their parents must be fed), plus, for a node in
        `chains`, a proposed continuation reviewed by the draft in the same forward. Returns the
        nodes that are now fed (reviewed chain tokens that survived included)."""
        chains = chains or {}
        batch = list(nodes)
        chain_of: dict[int, list[int]] = {}
        for node, chain in chains.items():
            prev, added = node, []
            for tok in chain:
                prev = self.add(prev, int(tok), source=REVIEW)
                added.append(prev)
            chain_of[node] = added
            batch += added
        if not batch:
            return []
            yield                                                   # (a coroutine even when empty)
        idx = np.asarray(batch)
        scratch = self.runner.cache.scratch
        # Visibility over existing scratch rows: rows owned by ancestors (pending rows belong to the root).
        owners = np.asarray(self.row_owner, dtype=np.int64)
        mask = np.concatenate([self.anc[idx][:, owners], self.anc[idx][:, idx]], axis=1)
        toks = torch.from_numpy(self.tokens[idx])
        pos = torch.from_numpy(self.base_pos + self.depth[idx])
        logits = yield from self.runner.run(toks, pos, torch.from_numpy(mask))
        self.forward_rows.append(len(batch))
        dists = self._dist(logits, batch)
        for i, node in enumerate(batch):
            self.row[node] = scratch + i
            self.row_owner.append(node)
            self.probs[node] = dists[i]
        yield from self._read(dists, batch, [c for added in chain_of.values() for c in added])
        done = list(nodes)
        for node, added in chain_of.items():
            prev = node
            self.reviewed += len(added)
            for child in added:                     # review: keep while the draft agrees
                probs, toks = self.top[prev]
                tok = int(self.tokens[child])
                if toks[0] == tok or (lenience > 1 and self.prob(prev, tok) * lenience >= probs[0]):
                    done.append(child)
                    self.review_kept += 1
                    prev = child
                else:
                    self.alive[child:added[-1] + 1] = False   # the rest of the chain hangs off it
                    break
        return done

    def _read(self, dists: torch.Tensor, batch: list[int], reviewed: list[int]) -> Calls:
        """The forward's one host read (with the draft round's other requests': runner.read): the
        top-k of every row of `dists` (the nodes of `batch`, in order) and the probability of each
        `reviewed` chain token at its parent (fed in this batch)."""
        vals, idx = dists.topk(min(self.top_k, dists.shape[-1]), -1)
        parts = [vals.flatten(), idx.flatten().to(vals.dtype)]      # token ids < 2^24: exact in float32
        if reviewed:
            rows = torch.tensor([batch.index(int(self.parents[c])) for c in reviewed], device=dists.device)
            parts.append(dists[rows, torch.as_tensor(self.tokens[reviewed], device=dists.device)])
        host = yield from read(torch.cat(parts))
        k, n = vals.shape[-1], len(batch)
        for i, node in enumerate(batch):
            self.top[node] = (host[i * k:(i + 1) * k], [int(t) for t in host[(n + i) * k:(n + i + 1) * k]])
        for j, child in enumerate(reviewed):
            self._known[int(self.parents[child]), int(self.tokens[child])] = host[2 * n * k + j]

    # -- hand-off to the target --------------------------------------------------------------
    def token_tree(self, nodes: list[int] | None = None) -> tuple[TokenTree, np.ndarray]:
        """The alive nodes (or an ancestor-closed subset) as a TokenTree, plus tree index -> node."""
        sel = np.flatnonzero(self.alive[: self.size]) if nodes is None else np.sort(np.asarray(nodes))
        where = np.full(self.size, -1, dtype=np.int64)
        where[sel] = np.arange(len(sel))
        parents = np.where(self.parents[sel] >= 0, where[self.parents[sel]], -1)
        qs = [self.q[n] for n in sel]
        q = None
        if any(x is not None for x in qs):
            ref = next(x for x in qs if x is not None)
            nan = torch.full_like(ref, float("nan"))
            q = torch.stack([nan if x is None else x for x in qs])
        return TokenTree(self.tokens[sel], parents, q), sel

    def reviewed_mask(self, nodes: np.ndarray) -> list[bool]:
        return self.from_review[nodes].tolist()

    def context(self, node: int) -> np.ndarray:
        """The sequence as it would read with `node` accepted: emitted tokens + the path to node."""
        return np.concatenate([self.st.tokens(), self.path(node)[1:]])

    def proposal(self, nodes: list[int] | None = None, path_flags: dict[str, str] | None = None,
                 **stats) -> Proposal:
        """The tree (alive nodes, or `nodes`) for the shared step, with each node's draft KV row (what
        its nodes are worth and the draft's forwards are the step's ledger).
        `path_flags`: {record name: node flag ("reviewed", "borrowed")} the step reports as whether
        the accepted path has a flagged node."""
        target_tree, sel = self.token_tree(nodes)
        rows = np.where((self.row[sel] >= 0) & ~self.borrowed[sel], self.row[sel], -1)
        flags = {"reviewed": self.from_review[sel], "borrowed": self.borrowed[sel]}
        return Proposal(target_tree, rows, len(self.pending), lambda: self.node_q(sel),
                        nodes={"reviewed": self.reviewed_mask(sel), "borrowed": flags["borrowed"].tolist()},
                        stats=stats, path_flags={name: flags[k] for name, k in (path_flags or {}).items()},
                        source=self.source[sel].copy())

    def node_q(self, nodes: np.ndarray) -> np.ndarray:
        """The draft's probability of each node's token given its parent (NaN for the root, and for a
        node whose parent was never fed), a scored drafter's candidate's score: what budget:
        auto's acceptance estimates are calibrated on (each source apart)."""
        out = self.score[nodes].copy()
        fed = [(i, int(self.parents[n]), int(self.tokens[n])) for i, n in enumerate(nodes.tolist())
               if self.parents[n] >= 0 and int(self.parents[n]) in self.probs and self.source[n] in (DRAFT, REVIEW)]
        unread = [(p, t) for _, p, t in fed if t not in self.top[p][1] and (p, t) not in self._known]
        if unread:                                  # sampled children outside the top-k: one read for all
            for (p, t), v in zip(unread, torch.stack([self.probs[p][t] for p, t in unread]).tolist()):
                self._known[p, t] = v
        for i, p, t in fed:
            out[i] = self.prob(p, t)
        return out
