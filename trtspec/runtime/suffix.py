"""Suffix trees of token histories (SuffixDecoding, Oliaro et al.): drafts that cost no model call.

`SuffixTree` counts every window of up to `depth` tokens of the sequences it holds: a trie whose
node for a token string w carries count(w), the times w occurred. It is fed incrementally (one
request's prompt and output, token by token: `Suffixes.extend`, O(depth) per token) or whole
sequences at a time (`add`, and `remove` to forget one again).

To draft, the longest suffix of the current context that the trie holds *with a continuation* is
matched (`match`), and the continuations below it are the candidates: a child token y of the match
has the empirical probability count(w·y) / sum of the children's counts. Several tries (the
request's own and a global one over finished requests) are read together by pooling their counts.

`SuffixStore` is the global trie of a scope (a server may keep one per user): finished
sequences go in, and the oldest are removed once it holds more than `max_nodes` nodes, so its memory
is bounded. It also keeps the scope's calibration of suffix scores (how often a score was accepted),
so a new request starts from what earlier ones measured, not from the prior f(q) = q. It is locked:
requests of any Generator may read and add concurrently.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, deque

from .budget.acceptance import Acceptance


class _Node:
    __slots__ = ("count", "kids")

    def __init__(self) -> None:
        self.count = 0
        self.kids: dict[int, _Node] = {}


class SuffixTree:
    def __init__(self, depth: int = 24):
        self.depth = depth
        self.root = _Node()
        self.nodes = 1

    def _bump(self, node: _Node, token: int) -> _Node:
        kid = node.kids.get(token)
        if kid is None:
            kid = node.kids[token] = _Node()
            self.nodes += 1
        kid.count += 1
        return kid

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Count `token` after the windows ending at the previous token (`active`, shortest first);
        returns the windows ending at `token`."""
        out = [self._bump(self.root, token)]
        out += [self._bump(node, token) for node in active[: self.depth - 1]]
        return out

    def add(self, tokens) -> None:
        active: list[_Node] = []
        for t in tokens:
            active = self.extend(active, int(t))

    def remove(self, tokens) -> None:
        """Forget one earlier `add` of `tokens` (counts go down; nodes at zero are dropped)."""
        tokens = [int(t) for t in tokens]
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + self.depth]:
                kid = node.kids[t]
                kid.count -= 1
                if kid.count == 0:
                    del node.kids[t]
                    self.nodes -= _size(kid)
                    break
                node = kid

    def walk(self, tokens) -> _Node | None:
        node = self.root
        for t in tokens:
            node = node.kids.get(int(t))
            if node is None:
                return None
        return node


def _size(node: _Node) -> int:
    return 1 + sum(_size(k) for k in node.kids.values())


def match(trees: list[SuffixTree], context, max_match: int) -> tuple[int, list[_Node]]:
    """The longest suffix of `context` (at most `max_match` tokens) that some tree holds with a
    continuation: (its length, the node of each tree that holds it with one). (0, []) if none."""
    ctx = [int(t) for t in context[-max_match:]]
    for n in range(len(ctx), 0, -1):
        nodes = [node for tree in trees if (node := tree.walk(ctx[-n:])) is not None and node.kids]
        if nodes:
            return n, nodes
    return 0, []


def continuations(nodes: list[_Node]) -> list[tuple[int, float, list[_Node]]]:
    """The children of the pooled `nodes`, most frequent first: (token, empirical probability, the
    child node in each tree that has one)."""
    counts: dict[int, int] = {}
    kids: dict[int, list[_Node]] = {}
    for node in nodes:
        for tok, kid in node.kids.items():
            counts[tok] = counts.get(tok, 0) + kid.count
            kids.setdefault(tok, []).append(kid)
    total = sum(counts.values())
    return sorted(((tok, c / total, kids[tok]) for tok, c in counts.items()), key=lambda x: (-x[1], x[0]))


class Suffixes:
    """One request's own trie over its prompt and output, fed as the sequence grows."""

    def __init__(self, depth: int):
        self.tree = SuffixTree(depth)
        self.active: list[_Node] = []
        self.seen = 0

    def sync(self, tokens) -> None:
        for t in tokens[self.seen:]:
            self.active = self.tree.extend(self.active, int(t))
        self.seen = len(tokens)


class SuffixStore:
    """A global trie over finished sequences, bounded by `max_nodes` (oldest sequences evicted)."""

    def __init__(self, depth: int, max_nodes: int):
        self.tree = SuffixTree(depth)
        self.max_nodes = max_nodes
        self.held: deque[list[int]] = deque()
        self.calibration = Acceptance()       # the scope's suffix calibration, from finished requests' steps
        self.lock = threading.Lock()

    def add(self, tokens) -> None:
        tokens = [int(t) for t in tokens]
        with self.lock:
            self.tree.add(tokens)
            self.held.append(tokens)
            while self.tree.nodes > self.max_nodes and self.held:
                self.tree.remove(self.held.popleft())

    def __len__(self) -> int:
        return len(self.held)


MAX_SCOPES = 64        # global tries kept at once; the least recently used is dropped past this
_STORES: OrderedDict[tuple[str, int, int], SuffixStore] = OrderedDict()
_STORES_LOCK = threading.Lock()


def store(scope: str, depth: int, vocab: int, max_nodes: int) -> SuffixStore:
    """The global trie of `scope` for a `vocab`-token vocabulary (one per scope, depth and vocabulary,
    created on first use; its cap is the largest asked for). At most MAX_SCOPES are kept (a server
    with one scope per user: the least recently used one is forgotten), so memory stays within
    MAX_SCOPES x the cap."""
    with _STORES_LOCK:
        key = (scope, depth, vocab)
        s = _STORES.get(key)
        if s is None:
            s = _STORES[key] = SuffixStore(depth, max_nodes)
            while len(_STORES) > MAX_SCOPES:
                _STORES.popitem(last=False)
        _STORES.move_to_end(key)
        s.max_nodes = max(s.max_nodes, max_nodes)
        return s


def forget(scope: str | None = None) -> None:
    """Drop the global tries of `scope` (every scope when None): a benchmark's warm-up must not teach
    them what the measured runs will write."""
    with _STORES_LOCK:
        for key in [k for k in _STORES if scope is None or k[0] == scope]:
            del _STORES[key]
