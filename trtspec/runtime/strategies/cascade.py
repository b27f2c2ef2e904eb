"""cascade: Cascade Speculative Drafting (Chen et al.), lossless at the top.

Levels: target <- draft model <- MaG (n-gram max-gram copy + optional greedy bigram table).
- Vertical cascade: the draft never decodes autoregressively. Each draft forward REVIEWS a MaG
  proposal (fed with the draft's pending token in one forward): MaG tokens are kept while they
  equal the draft's argmax (or pass the draft-level `lenience`), and the draft's own argmax at the
  first miss is appended, so every review yields at least one token. Repeat until `k_draft` tokens.
- Horizontal cascade (the K-matrix row [k_draft, k_mag]): the first k_draft positions come from
  the draft-reviewed tier, the next k_mag from raw MaG, the cheapest drafter for the least likely
  positions.
- Lenience applies below the top only; every level below the target is deterministic, so the
  target verifies with q = one-hot: greedy output is the target's greedy output and sampling is exact.

The cheap level is `drafter` (drafters/): the default `ngram` is MaG; with `suffix` (or `suffix:
true`) the request's suffix tries (its own tokens and its scope's finished requests) take MaG's
place in both tiers, and finished requests feed the scope's trie. With a list (`[suffix, ngram]`)
each chain is the first drafter's that is not empty.

With `k_draft: auto` (the default; cap `max_k_draft`) the budget (budget/auto.py) is asked once per
review: whether the draft's own next token pays for its verify cost, whether its review forward
pays, and the bar its kept MaG tokens must pass (each one's calibrated acceptance must pay for its
verify cost); the raw MaG tier (no draft probabilities to value it by) stays `k_mag` tokens after a
non-empty chain; a step where nothing pays is a plain ar step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field

from ...errors import ConfigError
from ...options import Drafters, auto_or
from ..budget import Round
from ..decode import DecodeState
from ..draft_model import DraftModel
from ..drafters import first_chain
from ..effects import Calls
from .base import Strategy

Count = Annotated[int, Field(ge=0, le=64)]


class Cascade(Strategy):
    name = "cascade"
    needs_draft = True

    def __init__(self, k_draft: auto_or(64) = "auto",
                 max_k_draft: Annotated[int, Field(ge=1, le=64)] = 8, k_mag: Count = 4, mag_len: Count = 6,
                 lenience: Annotated[float, Field(ge=1.0, allow_inf_nan=False)] = 1.0, bigram: str | None = None,
                 drafter: Drafters = "ngram", suffix: bool = False,
                 scope: Annotated[str, Field(max_length=128)] = "default"):
        self.k_draft, self.max_k_draft, self.k_mag = k_draft, max_k_draft, k_mag
        self.mag_len, self.lenience = mag_len, lenience
        self.sized(k_draft, max_k_draft)
        self.kd = self.nodes                         # the reviewed tier's tokens (its cap, with auto)
        self.nodes = self.kd + mag_len + k_mag       # + a last review's MaG tokens + the raw MaG tier
        table = _bigram(bigram) if bigram else None      # fills in the ngram drafter's misses (only its)
        self.scope = scope
        self.model = DraftModel()
        self.cheap_drafters(self.drafter_choice(drafter, suffix), only={"ngram": {"bigram": table}} if bigram else None,
                            scope=scope)

    def max_draft_rows(self) -> int:
        return self.kd * (self.mag_len + 1)        # every review may feed mag_len rejected tokens

    def propose(self, st: DecodeState) -> Calls:
        budget, values = st.budget, st.values
        # Every review may add mag_len nodes that the draft then rejects: they hold tree slots too.
        tree = yield from self.model.open(st, capacity=self.kd * (self.mag_len + 1) + self.k_mag + 2)
        chain: list[int] = []                       # node ids, in order
        last, value = 0, st.ledger.value            # each node's value, in the order it joined (the root first)
        while len(chain) < self.kd:
            v, tok, _ = tree.candidates(last, value[last])[0]      # the draft's own token
            leaf = len(chain) + 1 >= self.kd             # a leaf: no need to feed it
            proposal = [] if leaf else first_chain(self.drafters, st, np.append(tree.context(last), tok),
                                                   self.mag_len)[1]
            plan = budget.plan(Round([v], width=1, ahead=self.kd - len(chain) - 1,
                                     then=None if leaf else len(proposal), bar_ahead=0))
            if not plan.take:
                break
            node = tree.add(last, tok)
            value[node] = v
            chain.append(node)
            if not plan.feed:
                break
            fed = yield from tree.feed([node], {node: proposal} if proposal else None, self.lenience)
            for kept in fed[1:]:                     # a kept review token must pay for its verify cost too
                parent = int(tree.parents[kept])
                v = values.child(value[parent], tree.prob(parent, int(tree.tokens[kept])))
                if not plan.joins(v):
                    tree.cut(kept)
                    break
                value[kept] = v
                chain.append(kept)
            last = chain[-1]
        if chain:
            tag, raw = first_chain(self.drafters, st, tree.context(chain[-1]), self.k_mag)
            for tok in raw:                          # raw MaG tier, unreviewed
                chain.append(tree.add(chain[-1], int(tok), source=tag))
                value[chain[-1]] = 0.0               # verified, so counted; no probability to value it by
        return tree.proposal([0] + chain, stage2_proposed=tree.reviewed,
                             stage2_accepted=tree.review_kept)


def _bigram(path: str) -> np.ndarray:
    """The greedy bigram table (token -> next token), a 1-D integer .npy file."""
    try:
        table = np.load(Path(path).expanduser(), allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ConfigError(f"strategies.cascade.bigram = {path!r}: cannot read it as a .npy table ({e})") from None
    if table.ndim != 1 or table.dtype.kind not in "iu":
        raise ConfigError(f"strategies.cascade.bigram = {path!r}: expected a 1-D integer array (token -> next "
                          f"token), got shape {table.shape} of {table.dtype}")
    return table
