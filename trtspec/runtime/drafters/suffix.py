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
"""
from __future__ import annotations

import heapq
import itertools

from ..decode import DecodeState
from ..suffix import Suffixes, continuations, match, store
from .base import Candidate, Drafter

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
# In a tree the draft grows, the tries' candidates stand beside its own only after a match of at least
# this many tokens (Drafter.mix_match). After a 1-2 token match the most frequent continuation was
# the next token 19-47% of the time on code edits (MATCH_DOUBT); on HumanEval the n-gram staged's
# draft nodes were accepted 72% of the time, and mixed trees' suffix candidates took their slots
# (131 of 419 accepted, 0.94x the n-gram staged's speed). Whether a step is a suffix tree alone (no
# draft forward) still weighs every candidate.
MIX_MATCH = 3


class SuffixDrafter(Drafter):
    name = "suffix"             # also where the request's own trie is kept, in its strategy_state
    scored = True
    mix_match = MIX_MATCH

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
