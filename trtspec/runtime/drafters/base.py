"""Drafter: a part that proposes candidate tokens at no model call, for any strategy to grow trees from.

A strategy is a policy over drafters: it asks them for candidates, values and sizes its tree with the
request's Values and budget, and hands the tree to the shared step. A drafter only proposes.

- `chain(st, context, n)`: its most likely continuation of `context` (up to `n` tokens): the cheap
  chain a draft model reviews (staged's stage 2, cascade's levels) or a chain verified as it is
  (the `ngram` strategy).
- `candidates(st, cap)`: (the length of the match it drafts from, up to `cap` scored candidates
  best first), a tree from the root: each candidate's parent comes before it and its value is at
  most its parent's, so any prefix is a tree. Only a `scored` drafter has them: its scores are
  calibrated apart from every other drafter's (Values, by the drafter's `tag`); an unscored one
  proposes chains only.
- `finished(st, prompt, output)`: a request ended normally: what the drafter may learn from it.
- `prepare(st)`: before each step's proposal, a coroutine that may ask a model role for what the
  step's candidates need (a head's forward over the target's last hidden row, heads.ask: run with
  the phase's other requests' in one batched forward); most drafters need nothing.

What every drafter declares: its `name` (the registry's, and its nodes' tag), whether it is
`scored`, whether it `reads_hidden` (the target's hidden rows) and the kind of head role it asks
(`reads_head`). The draft model is not a drafter: it is a part of its own (draft_model.py), which a
strategy that runs it holds as `model`, beside its drafters. A strategy takes a list of drafters
(`drafter: [suffix, ngram]`), as llama.cpp chains its speculators: a chain is the first drafter's
that is not empty (`first_chain`), and the scored drafters' candidates join one tree, a path two of
them propose joining once, as the better's (`merged`); each node keeps the tag of the drafter that
proposed it.

Per-request state lives in the request's DecodeState (`st.strategy_state`, under the drafter's
name), never on the drafter, which a strategy shares between requests. Every node a drafter
proposes carries its `tag`, so the step's `sources` report counts it under its name. Drafters are
deterministic: verified with q = one-hot, they are lossless whatever they propose.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..budget import Round
from ..decode import DecodeState
from ..effects import Calls
from ..proposal import DRAFT, Proposal, tag
from ..tree import TokenTree


@dataclass(frozen=True)
class Candidate:
    parent: int          # index of the parent candidate in the list; -1: the root (last emitted token)
    token: int
    prob: float          # the drafter's score: its probability given the parent, before calibration
    value: float         # the budget's value: P(reached and accepted)


class Drafter:
    name = "base"
    scored = False       # `candidates` gives scored trees (else chains only)
    reads_hidden = False  # it reads `st.hidden`, the target's hidden rows (a head: target.hidden_rows)
    reads_head: str | None = None   # the kind of head role it asks (`heads:` in the config; st.heads)

    def __init__(self, scope: str = "default") -> None:
        self.scope = scope            # what a drafter that learns across requests shares them by

    @cached_property
    def tag(self) -> int:
        """Its nodes' source (proposal.SOURCES): its name."""
        return tag(self.name)

    def chain(self, st: DecodeState, context: np.ndarray, n: int) -> list[int]:
        raise NotImplementedError

    def candidates(self, st: DecodeState, cap: int) -> tuple[int, list[Candidate]]:
        return 0, []

    def prepare(self, st: DecodeState) -> Calls:
        """What this step's candidates need from a model role, asked before the proposal (a coroutine)."""
        return
        yield                                       # noqa: unreachable: a coroutine with no call

    def finished(self, st: DecodeState, prompt: list[int], output: list[int]) -> None:
        pass

    def stats(self, matched: int) -> dict:
        """What a step that drew on its candidates reports of them: the length of their match."""
        return {f"{self.name}_match": matched} if self.scored else {}

    def alone(self, st: DecodeState, cap: int) -> Proposal:
        """A step's tree of this drafter's candidates alone (up to `cap` nodes; see `as_tree`)."""
        return together(st, [self], cap)


Offer = tuple[Drafter, int, list[Candidate]]        # a scored drafter, the length of its match, its candidates


def offers(st: DecodeState, drafters: list[Drafter], cap: int) -> list[Offer]:
    """Each scored drafter's candidates (up to `cap`), with the length of the match behind them."""
    return [(d, *d.candidates(st, cap)) for d in drafters if d.scored]


def offer_stats(offered: list[Offer]) -> dict:
    """What a step that drew on these offers reports of them (each drafter's `stats`)."""
    return {k: v for d, matched, _ in offered for k, v in d.stats(matched).items()}


def first_chain(drafters: list[Drafter], st: DecodeState, context: np.ndarray, n: int) -> tuple[int, list[int]]:
    """(its drafter's tag, the chain): the first drafter's chain of `context` that is not empty."""
    for d in drafters:
        if chain := d.chain(st, context, n):
            return d.tag, chain
    return drafters[0].tag, []


def merged(offered: list[Offer], cap: int) -> tuple[list[Candidate], list[int]]:
    """The offers' candidates as one tree, best first, and the tags of its nodes (the root's first: the
    first drafter's): a path two drafters propose joins once (as the better candidate; the other's
    children hang under it), up to `cap` candidates. One drafter's candidates come back as they are."""
    first = offered[0][0].tag if offered else DRAFT
    if len(offered) <= 1:
        cands = offered[0][2] if offered else []
        return cands, [first] * (len(cands) + 1)
    ranked = sorted((-c.value, r, i) for r, (_, _, cands) in enumerate(offered) for i, c in enumerate(cands))
    index: dict[tuple[int, int], int] = {}               # (offer, candidate) -> its place in the tree
    where: dict[tuple[int, int], int] = {}               # (parent's place, token) -> place
    out, tags = [], [first]
    for _, r, i in ranked:                              # a parent's value is at least its child's: first
        d, _, cands = offered[r]
        c = cands[i]
        key = (-1 if c.parent < 0 else index[r, c.parent], c.token)
        if key not in where:
            if len(out) == cap:
                break
            where[key] = len(out)
            out.append(Candidate(key[0], c.token, c.prob, c.value))
            tags.append(d.tag)
        index[r, i] = where[key]
    return out, tags


def together(st: DecodeState, drafters: list[Drafter], cap: int) -> Proposal:
    """A step's tree of the scored drafters' candidates alone (merged, up to `cap`; see `as_tree`)."""
    offered = offers(st, drafters, cap)
    return as_tree(st, *merged(offered, cap), offer_stats(offered))


def as_tree(st: DecodeState, cands: list[Candidate], tags: list[int], stats: dict) -> Proposal:
    """Candidates (best first) alone as the step's tree, its nodes tagged `tags` (root first): the
    prefix of them that maximises the step's expected rate by the budget, if that beats the batch all
    at ar (all of them with a fixed budget)."""
    cands = cands[: st.budget.plan(Round(known=[c.value for c in cands], free=True)).take]
    tree = TokenTree([st.root] + [c.token for c in cands], [-1] + [c.parent + 1 for c in cands])
    node_q = np.array([np.nan] + [c.prob for c in cands])
    source = np.array(tags[: len(cands) + 1], dtype=np.int64)
    st.ledger.joined([c.value for c in cands])
    return Proposal(tree, node_q=lambda: node_q, stats=stats, source=source)
