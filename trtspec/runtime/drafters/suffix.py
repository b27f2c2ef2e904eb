"""SuffixDrafter (`suffix`): the candidates a request's suffix tries propose, best first, at no model call.

A scored drafter (base.py): the `suffix` strategy verifies a tree of these alone, and the tree
strategies mix them with the draft model's candidates (`staged` with `drafter: suffix`). The
request's own trie (its prompt and output so far) and, unless `scope` is empty, the global trie of
that scope (finished requests' outputs, and prompts with `prompts: true`; bounded by
`global_nodes`, oldest forgotten first) are matched against the longest suffix of the sequence
they hold with a continuation (at most `max_match` tokens). The candidates grow best-first from
there: a node's score is its empirical probability (pooled counts) discounted by how short the
match behind it is (MATCH_DOUBT), its value its parent's times the budget's calibrated acceptance
of that score; up to `width` children per node, `min_prob` at least, never deeper than the tries
remember.

Every candidate's value is at most its parent's and parents come first, so any prefix of the list
is a tree. The drafts are deterministic (q = one-hot under sampling): lossless like every drafter.

The tries behind it: suffix trees of token histories (SuffixDecoding, Oliaro et al.).

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

import heapq
import itertools
import threading
from collections import OrderedDict, deque

from ..budget.acceptance import Acceptance
from ..decode import DecodeState
from .base import Candidate, Drafter


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


# How much a continuation seen after a matched suffix of m tokens is to be believed: its empirical
# probability times 1 - MATCH_DOUBT**m. A one-token match predicts little (measured with the Qwen
# pair's greedy outputs: the most frequent continuation was the next token 19% of the time after a
# 1-token match on code edits and 45% on repeated JSON requests; 47% / 76% after 2 tokens; 93-97%
# after 4 or more), so the score the budget calibrates starts near what it will learn (0.4, 0.64,
# 0.78, 0.87, ... for m = 1, 2, 3, 4). A node d levels below the match has matched m + d - 1 tokens.
MATCH_DOUBT = 0.6
# A request's suffix calibration starts from its scope's (earlier requests' accepted and rejected
# suffix nodes), believed as at most CARRY observations per bin so the request still learns its own;
# the scope keeps at most KEEP per bin, so it follows the traffic.
CARRY, KEEP = 32.0, 2000.0
SEED = "suffix_seed"     # the calibration a request started from, in its strategy_state


class SuffixDrafter(Drafter):
    name = "suffix"             # also where the request's own trie is kept, in its strategy_state
    scored = True

    def __init__(self, scope: str = "default", width: int = 4, min_prob: float = 0.05, depth: int = 24,
                 max_match: int = 16, prompts: bool = False, global_nodes: int = 500_000):
        super().__init__(scope)
        self.width, self.min_prob, self.depth = width, min_prob, depth
        self.max_match = min(max_match, depth - 1)
        self.prompts, self.global_nodes = prompts, global_nodes

    def _store(self, st: DecodeState):
        """The global trie of this scope for this target's vocabulary (histories of models with another
        vocabulary are never proposed to it), or None when the global trie is off."""
        if not self.scope:
            return None
        return store(self.scope, self.depth, st.target.engine.spec.vocab_size, self.global_nodes)

    def _tries(self, st: DecodeState):
        """The request's own trie (synced to its sequence) and the scope's store (None: off). On the
        request's first call its suffix calibration starts from the scope's."""
        own, shared = st.strategy_state.get(self.name), self._store(st)
        if own is None:
            own = st.strategy_state[self.name] = Suffixes(self.depth)
            f = st.values.of(self.tag)                       # calibrated values only (budget auto)
            if shared is not None and f is not None:
                with shared.lock:
                    f.carry(shared.calibration, CARRY)
                st.strategy_state[SEED] = f.copy()
        own.sync(st.tokens())
        return own.tree, shared

    def candidates(self, st: DecodeState, cap: int) -> tuple[int, list[Candidate]]:
        """(the matched suffix length, up to `cap` candidates best first)."""
        own, shared = self._tries(st)
        if shared is None:
            return self._grow(st, [own], cap)
        with shared.lock:                         # other requests may add to it meanwhile
            return self._grow(st, [own, shared.tree], cap)

    def chain(self, st: DecodeState, context, n: int) -> list[int]:
        """The most frequent continuation (up to `n` tokens) of the longest suffix of `context` the tries
        hold: a cheap chain for a draft model to review (staged's stage 2)."""
        own, shared = self._tries(st)
        if shared is None:
            return _follow([own], context, self.max_match, n)
        with shared.lock:
            return _follow([own, shared.tree], context, self.max_match, n)

    def _grow(self, st: DecodeState, trees, cap: int) -> tuple[int, list[Candidate]]:
        values = st.values
        matched, nodes = match(trees, st.tokens(), self.max_match)
        out: list[Candidate] = []
        heap: list = []
        order = itertools.count()                 # ties: the earlier candidate first
        room = self.depth - matched               # the tries remember windows of `depth` tokens

        def push(parent: int, value: float, under, depth: int) -> None:
            if depth > room:
                return
            trust = 1 - MATCH_DOUBT ** (matched + depth - 1)
            for tok, p, kids in continuations(under)[: self.width]:
                v = values.child(value, p * trust, self.tag)
                if v >= self.min_prob:
                    heapq.heappush(heap, (-v, next(order), parent, tok, p * trust, kids, depth))

        if nodes:
            push(-1, 1.0, nodes, 1)
        while heap and len(out) < cap:
            neg, _, parent, tok, p, kids, depth = heapq.heappop(heap)
            out.append(Candidate(parent, tok, p, -neg))
            push(len(out) - 1, -neg, kids, depth + 1)
        return matched, out

    def finished(self, st: DecodeState, prompt: list[int], output: list[int]) -> None:
        """A request ended normally: its output (and prompt, with `prompts`) joins the scope's trie, and
        what its steps measured of suffix scores joins the scope's calibration."""
        shared = self._store(st)
        if shared is None:
            return
        if output:
            shared.add((prompt if self.prompts else []) + output)
        seed = st.strategy_state.get(SEED)
        if seed is not None:
            with shared.lock:
                shared.calibration.absorb(st.values.of(self.tag), seed, KEEP)


def _follow(trees, context, max_match: int, n: int) -> list[int]:
    ctx = [int(t) for t in context[-max_match:]]
    out: list[int] = []
    _, nodes = match(trees, ctx, max_match)
    while nodes and len(out) < n:
        tok, _, nodes = continuations(nodes)[0]
        out.append(tok)
        nodes = [k for k in nodes if k.kids]
    return out
