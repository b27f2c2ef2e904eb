"""chain: Leviathan/Chen speculative decoding with a draft model.

k draft tokens, one by one (greedy, or sampled with their q rows kept so acceptance stays exact),
then one target forward over the chain; the bonus token comes free when all k are accepted.
With `k: auto` (the default) the budget (budget/auto.py), asked once per token (take it, then feed
it?), stops the chain at the first token whose acceptance estimate does not pay for its verify cost
and draft forward, up to `max_k`; a step where none pays is a plain ar step.
"""
from __future__ import annotations

import numpy as np
import torch

from ...options import Budget, TreeSize
from ..budget import Round
from ..decode import DecodeState
from ..draft_model import DraftModel
from ..effects import Calls, read
from ..proposal import Proposal
from ..sampling import inverse_cdf, keyed_on
from ..tree import TokenTree
from .base import Strategy


class ChainSpeculative(Strategy):
    """k draft-model tokens per target step."""
    name = "chain"
    needs_draft = True

    def __init__(self, k: Budget = "auto", max_k: TreeSize = 8):
        self.k, self.max_k = k, max_k
        self.sized(k, max_k)
        self.model = DraftModel()                 # the draft model alone

    def max_draft_rows(self) -> int:
        return self.nodes - 1

    def propose(self, st: DecodeState) -> Calls:
        """Greedy or sampled chain from the draft model (sampled: each token drawn with its position's
        keyed uniform, its q row kept). The draft cache may lag the sequence by a token or two (the
        bonus token, or the last draft whose KV was never computed), so the first call feeds every
        pending token with the root. Draft row of node i (i >= 1): pending + i - 1, for the drafts
        the draft was fed."""
        model, budget, values, greedy = self.model, st.budget, st.values, st.sampling.greedy
        yield from model.catch_up(st)
        pending = st.pending()
        logits = yield from model.extend(st, pending)    # (the draft model records its forwards in the ledger)
        drafts: list[int] = []
        qs, probs = [], []
        value, fed = 1.0, 0
        # sampled: the uniforms of the positions the drafts may take, on the device in one copy
        u = None if greedy else keyed_on(logits.device, st.seed, st.n_tokens + np.arange(self.nodes))
        for i in range(self.nodes):
            logits = st.constrain(logits[-1:], [drafts])      # a grammar's mask after the drafts so far
            if greedy:                  # the argmax and its probability (the top-1): one host read
                q = torch.softmax(logits[-1].float(), -1)
                top, tok = yield from read(torch.stack([q.max(), logits[-1].argmax().to(q.dtype)]))  # ids < 2^24
                tok = int(tok)
                values.saw_top1(top)
                v = values.child(value, top)
            else:                       # decided before the draw (Values.drawn), then drawn
                q = st.draft_probs(logits[-1:])[0]
                values.saw_top1(q.max())           # a device scalar: only calibrated values read it
                v = values.drawn(value, q, q)
            plan = budget.plan(Round([v], width=1, ahead=self.nodes - i - 1,
                                     then=None if i == self.nodes - 1 else 0))   # take it, then feed it?
            if not plan.take:
                break
            st.ledger.value[i + 1] = v          # the step's facts: each node's value
            value = v
            if not greedy:
                # drawn with the uniform the target's token at this position is drawn with (verify.drawn)
                tok = (yield from read(inverse_cdf(q[None], u[i:i + 1])))[0]   # with its round's reads
                qs.append(q)
            probs.append(top if greedy else q[tok])   # sampled: read only if the budget calibrates
            drafts.append(tok)
            if not plan.feed:
                break
            logits = yield from model.extend(st, [tok])
            fed += 1
        # row 0 (the root) is never verified against q
        q_rows = torch.stack([torch.full_like(qs[0], float("nan"))] + qs) if qs else None
        rows = np.full(len(drafts) + 1, -1, dtype=np.int64)
        rows[1:fed + 1] = np.arange(len(pending), len(pending) + fed)
        return Proposal(TokenTree.chain(st.root, drafts, q_rows), rows, len(pending),
                        lambda: np.array([np.nan] + (probs if greedy or not probs else torch.stack(probs).tolist())))
