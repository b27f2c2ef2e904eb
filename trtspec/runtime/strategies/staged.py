"""staged: Spector & Ré's staged speculative decoding, mixed with suffix drafts.

Stage 1, the tree the target verifies: best-first by cumulative draft probability (the product of
draft probabilities along the path), so width lands near the root where it buys the most, under a
node budget. Each round adds the `width` best candidates and feeds them to the draft in ONE batched
forward (the draft runs only on internal nodes: the last round's leaves are never fed).
Stage 2, speeding up the draft itself: in the same forward, a cheap drafter proposes a chain after
the round's best node and the draft reviews it (kept while it equals the draft's argmax), so one
draft forward can advance several levels. The cheap drafters are `drafter` (drafters/: the default
`ngram`, CS Drafting's MaG; `suffix`, the request's suffix tries; `suffix: true` is `drafter: suffix`;
a list, e.g. `[suffix, ngram]`: the chain is the first one's that is not empty).
A scored drafter's candidates (`suffix`, drafters/suffix.py) also grow from the root: they compete
in the same best-first heap as the draft's, each valued by its own calibrated score. The heap holds
every source's candidates alike, `(-value, order, source, key)`: the draft's children
(`DraftChildren`: finding them costs a forward, so a round takes at most `width`) and each scored
drafter's (`Offered`: they cost no forward, so a round may take a whole chain of them). A picked
one is fed like any other node, so the draft extends the tree where a drafter's match runs out.
Once such a candidate's parent is fed, the draft's view counts too: a token outside the parent's
top-k is worth at most the k-th probability there.
Before any draft forward the budget decides whether one pays at all: where the
drafters' candidates alone make the better step (a repetitive stretch), the step is a tree of them
alone (merged, drafters/base.py) and the draft catches up later; where the gate finds no draft
forward worth it (a crowded batch), that tree is still proposed (`free`). Beside a drafter that
offers a tree every step (a head, `reads_head`), that decision is first made with an optimistic
draft until the request has seen the draft's top-1 (`Round.measure`): else the prior alone keeps
the draft from ever being fed, so from ever being measured (docs/bench/head-role/why_no_draft.txt).
Children are deterministic (top tokens, copies), so sampling verification uses the exact q = one-hot
rule. With `budget: auto` (the default) the budget (budget/auto.py) is asked once per round: how many
of the best candidates pay for their verify cost, whether the draft forward that feeds them (with
the stage-2 chain of the best) pays, and the bar a reviewed token the draft keeps must pass, up to
`max_budget` nodes; a step where no tree pays is a plain ar step.
"""
from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Annotated

import numpy as np
from pydantic import Field

from ...options import Budget, Drafters, Fraction, TreeSize
from ..budget import Plan, Round, Values
from ..decode import DecodeState
from ..draft_model import DraftModel
from ..drafters import Candidate, Drafter, as_tree, first_chain, merged, offer_stats, offers, together
from ..effects import Calls
from ..proposal import DRAFT, Proposal
from .base import Strategy

if TYPE_CHECKING:
    from ..draft_model import DraftTree

Small = Annotated[int, Field(ge=1, le=64)]
# In a tree the draft grows, the candidates of a drafter that matches the sequence (the suffix tries)
# stand beside the draft's own only after a match of at least `mix_match` tokens (a head's, which
# matches nothing, always). After a 1-2 token match the tries' most frequent continuation was the
# next token 19-47% of the time on code edits (drafters/suffix.py, MATCH_DOUBT); on HumanEval the
# n-gram staged's draft nodes were accepted 72% of the time, and mixed trees' suffix candidates took
# their slots (131 of 419 accepted, 0.94x the n-gram staged's speed). Whether a step is a tree of the
# drafters' candidates alone (no draft forward) still weighs every candidate.
MIX_MATCH = 3


class Staged(Strategy):
    name = "staged"
    needs_draft = True

    def __init__(self, budget: Budget = "auto", max_budget: TreeSize = 32, width: Small = 6, top_k: Small = 4,
                 max_rounds: Small = 8, stage2: bool = True, stage2_len: Annotated[int, Field(ge=0, le=64)] = 6,
                 min_prob: Fraction = 0.01, drafter: Drafters = "ngram", suffix: bool = False,
                 scope: Annotated[str, Field(max_length=128)] = "default",
                 mix_match: Annotated[int, Field(ge=0, le=64)] = MIX_MATCH):
        self.budget, self.max_budget, self.width, self.top_k = budget, max_budget, width, top_k
        self.mix_match = mix_match
        self.max_rounds = max_rounds
        self.stage2, self.stage2_len, self.min_prob = stage2, stage2_len, min_prob
        self.sized(budget, max_budget)
        self.scope = scope
        self.model = DraftModel()
        self.scored = [d for d in self.cheap_drafters(self.drafter_choice(drafter, suffix), scope=scope) if d.scored]

    def free(self, st: DecodeState) -> Proposal:
        if not self.scored:
            return Proposal.root(st.root)
        return together(st, self.scored, self.nodes)

    def max_tree_size(self) -> int:
        return self.nodes + (self.max_rounds * self.stage2_len if self.stage2 else 0) + 1

    def max_draft_rows(self) -> int:
        return self.max_tree_size() - 1        # fed nodes + reviewed stage-2 tokens

    def propose(self, st: DecodeState) -> Calls:
        budget, values = st.budget, st.values
        offered = offers(st, self.scored, self.nodes)
        sfx, tags = merged(offered, self.nodes)
        measure = any(d.reads_head for d, _, cands in offered if cands)    # a head offers a tree every step
        if sfx and not budget.plan(Round(known=[c.value for c in sfx], feed=_draft_frontier(sfx), rows=2,
                                         ahead=self.max_rounds, measure=measure)).feed:
            return as_tree(st, sfx, tags, offer_stats(offered))   # no draft forward pays: the drafters' alone
        tree = yield from self.model.open(st, capacity=self.max_tree_size() + 1, top_k=self.top_k)
        if measure:
            values.measure_top1(tree.top[0][0][0])        # the draft's first measure replaces its prior
        order = itertools.count()                  # heap ties: the earlier candidate first
        value = st.ledger.value                    # each node's value, in the order it joined (the root first)
        heap: list = []                            # (-value, order, source, key): the candidates of every source
        draft = DraftChildren(self.min_prob)
        draft.push(heap, order, tree, 0, 1.0)
        for d, matched, cands in offered:          # the draft's tree: no short-match guesses in it
            if d.reads_head or matched >= self.mix_match:
                Offered(d, cands, self.min_prob).push(heap, order)
        added = 0
        for rnd in range(self.max_rounds):
            last = rnd == self.max_rounds - 1                       # its nodes are leaves: never fed
            head = heap[0][2].place(heap[0][3]) if heap else None   # where this round's stage 2 will start
            guess = [] if last or head is None else self._stage2(st, tree, *head)
            plan = budget.plan(Round(sorted(-c[0] for c in heap)[::-1],
                                     width=self.width, ahead=self.max_rounds - rnd - 1,
                                     then=None if last else len(guess), bar_ahead=0))
            new = self._pick(heap, order, tree, min(plan.take, self.nodes - added), values, value)
            if not new:
                break
            added += len(new)
            if added >= self.nodes or not plan.feed:
                break
            best = (int(tree.parents[new[0]]), int(tree.tokens[new[0]]))
            chain = guess if best == head else self._stage2(st, tree, *best)
            chains = {new[0]: chain} if chain else {}
            for node in (yield from tree.feed(new, chains)):
                if node in value or self._keep_reviewed(st, tree, node, value, plan):
                    draft.push(heap, order, tree, node, value[node])
        return tree.proposal(stage2_proposed=tree.reviewed, stage2_accepted=tree.review_kept,
                             **offer_stats(offered))

    def _pick(self, heap: list, order, tree: DraftTree, room: int, values: Values, value: dict) -> list[int]:
        """The best candidates off the heap, added to the tree (new node ids): up to `room` of them, at
        most `width` of those that cost a forward to find (the draft's; a drafter's candidates cost
        none, so its chain can join in one round and be fed at once). A candidate whose token is
        already under its parent is skipped (a drafter's then stands for that node). A drafter's
        candidate is valued again as it comes off the heap (`Offered.settle`): if that is lower, it
        goes back."""
        new: list[int] = []
        held: list = []                            # the draft's candidates past `width` this round
        drafted = 0
        while heap and len(new) < room:
            item = heapq.heappop(heap)
            neg, _, src, key = item
            if src.forward and drafted >= self.width:
                held.append(item)
                continue
            if not src.settle(key, -neg, tree, values, value, heap, order):
                continue                           # valued lower: back on the heap, or dropped
            parent, tok = src.place(key)
            have = tree.children(parent)
            same = have[tree.tokens[have] == tok]
            if len(same):
                src.joined(key, int(same[0]))
                continue
            node = tree.add(parent, tok, score=src.score(key), source=src.tag)
            src.joined(key, node)
            drafted += src.forward
            value[node] = -neg
            new.append(node)
        for item in held:
            heapq.heappush(heap, item)
        return new

    def _stage2(self, st: DecodeState, tree: DraftTree, parent: int, token: int) -> list[int]:
        """Stage 2: the cheap drafters' chain after a node (`token` under `parent`: the round's most likely
        one), for the draft to review in the same forward. Asked before the round's plan (its rows
        are the forward's), for the best candidate."""
        if not self.stage2:
            return []
        return first_chain(self.drafters, st, np.append(tree.context(parent), token), self.stage2_len)[1]

    @staticmethod
    def _keep_reviewed(st: DecodeState, tree: DraftTree, node: int, value: dict, plan: Plan) -> bool:
        """A stage-2 token the draft's review kept: in the tree if it is worth verifying, by the round's
        bar (else it and its subtree are cut). Nodes under a cut token are not alive."""
        if not tree.alive[node]:
            return False
        parent = int(tree.parents[node])
        v = st.values.child(value[parent], tree.prob(parent, int(tree.tokens[node])))
        if not plan.joins(v):
            tree.cut(node)
            return False
        value[node] = v
        return True


class DraftChildren:
    """The draft model's candidates in the heap: the top-k children of each fed node (key: (parent
    node, token)), valued once, when their parent is fed; finding them costs a draft forward."""
    tag, forward = DRAFT, True

    def __init__(self, min_prob: float):
        self.min_prob = min_prob

    def push(self, heap: list, order, tree: DraftTree, node: int, value: float) -> None:
        """Candidate children of a fed node (`tree.candidates`), keyed by value (max-heap via -value):
        the cumulative draft probability, or with budget auto the calibrated probability of acceptance."""
        have = set(tree.tokens[tree.children(node)].tolist())
        for v, tok, _ in tree.candidates(node, value):
            if tok not in have and v >= self.min_prob:
                heapq.heappush(heap, (-v, next(order), self, (node, tok)))

    def place(self, key: tuple[int, int]) -> tuple[int, int]:
        return int(key[0]), int(key[1])

    def settle(self, *_) -> bool:
        return True

    def joined(self, key, node: int) -> None:
        pass

    def score(self, key) -> float:
        return np.nan


class Offered:
    """A scored drafter's candidates in the heap (key: the candidate's index; parents first, never
    valued above them, so popped first). They cost no forward; each is valued again as it comes off
    the heap (`settle`), as its parent's node stands then and as the draft sees it once that node is
    fed, and joins under its parent's node."""
    forward = False

    def __init__(self, drafter: Drafter, cands: list[Candidate], min_prob: float):
        self.tag, self.cands, self.min_prob = drafter.tag, cands, min_prob
        self.at = [0] * len(cands)                 # the tree node each popped candidate became
        self.cur = [c.value for c in cands]        # each one's value now (the draft may have lowered it)

    def push(self, heap: list, order) -> None:
        for i, c in enumerate(self.cands):
            heapq.heappush(heap, (-c.value, next(order), self, i))

    def place(self, i: int) -> tuple[int, int]:
        """(parent node, token): under the root while its parent candidate has not joined."""
        c = self.cands[i]
        return (0 if c.parent < 0 else self.at[c.parent]), c.token

    def joined(self, i: int, node: int) -> None:
        self.at[i] = node

    def score(self, i: int) -> float:
        return self.cands[i].prob

    def settle(self, i: int, v0: float, tree: DraftTree, values: Values, value: dict, heap: list, order) -> bool:
        """True if candidate `i` still has its heap value `v0` and its parent has joined; else it goes
        back on the heap with its value now (after its parent), or is dropped below `min_prob`."""
        c = self.cands[i]
        v = self._value(tree, values, value, i)
        if not (v < v0 or (c.parent >= 0 and not self.at[c.parent])):
            return True
        v = min(v, v0)
        self.cur[i] = v if v >= self.min_prob else 0.0        # dropped: its subtree goes too
        if v >= self.min_prob:
            heapq.heappush(heap, (-v, next(order), self, i))
        return False

    def _value(self, tree: DraftTree, values: Values, value: dict, i: int) -> float:
        """Its value now: its score's chain under its parent's value now (the parent's node may be the
        draft's, or lowered), and at most what the draft allows once its parent is fed: a token
        outside the parent's top-k has at most the k-th probability there (the draft seldom misses
        what the target will say: on HumanEval 15 of 531 suffix nodes were accepted when they were
        valued by their scores alone)."""
        c, cands = self.cands[i], self.cands
        if c.parent < 0:
            node, v = 0, c.value
        elif not self.at[c.parent]:                 # its parent is not in the tree (yet): below it
            return self.cur[c.parent] * c.value / cands[c.parent].value
        else:
            node = self.at[c.parent]
            v = value[node] * c.value / cands[c.parent].value
        top = tree.top.get(node)
        if top is not None and c.token not in top[1]:
            v = min(v, values.child(value[node], min(top[0])))
        return v


def _draft_frontier(sfx: list) -> list[float]:
    """Where a draft model would add to the suffix candidates `sfx` (best first): wherever their best
    chain is wrong (at each of its nodes, and the root, the chance of reaching it but not its suffix
    child: v_i - v_{i+1}) and past its end (the suffix match runs out: its last value). The values
    the budget's look-ahead grows guessed draft children from; they sum to 1, as the tree's reach."""
    chain, node = [1.0], -1
    for i, c in enumerate(sfx):                   # the best chain: each node's first (best) child
        if c.parent == node:
            chain.append(c.value)
            node = i
    return [a - b for a, b in itertools.pairwise(chain)] + [chain[-1]]
