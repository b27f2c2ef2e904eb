"""chain: Leviathan/Chen speculative decoding with a draft model.

k draft tokens, one by one (greedy, or sampled with their q rows kept so acceptance stays exact),
then one target forward over the chain; the bonus token comes free when all k are accepted.
With `k: auto` (the default) the policy (adaptive.py) stops the chain at the first token whose
acceptance estimate does not pay for its verify cost and draft forward, up to `max_k`; a step
where none pays is a plain ar step.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ...options import Budget, TreeSize
from ..decode import DecodeState
from ..runner import Calls
from ..sampling import sample
from ..tree import TokenTree
from .base import Strategy


class ChainSpeculative(Strategy):
    """k draft-model tokens per target step."""
    name = "chain"
    needs_draft = True

    def __init__(self, k: Budget = "auto", max_k: TreeSize = 8):
        self.k, self.max_k = k, max_k
        self.nodes = max_k if k == "auto" else k

    def auto_nodes(self) -> int | None:
        return self.nodes if self.k == "auto" else None

    def max_tree_size(self) -> int:
        return self.nodes + 1

    def max_draft_rows(self) -> int:
        return self.nodes - 1

    def draft(self, st: DecodeState) -> Calls:
        """Greedy or sampled chain from the draft model. Returns (drafts, q rows or None, each
        draft's probability, pending, drafts whose KV the draft computed).

        The draft cache may lag the sequence by a token or two (the bonus token, or the last draft
        whose KV was never computed), so the first call feeds every pending token with the root."""
        runner, pol = st.draft, st.policy
        yield from st.draft_catch_up()
        pending = st.tokens()[runner.cache.length:].tolist()
        logits = yield from runner.extend(pending)
        if pol is not None:
            pol.opened(len(pending))
        drafts: list[int] = []
        qs, probs = [], []
        value, fed = 1.0, 0
        for i in range(self.nodes):
            if st.sampling.greedy:
                q = torch.softmax(logits[-1].float(), -1) if pol is not None else None
                tok = int(logits[-1].argmax())
            else:
                q = st.draft_probs(logits[-1:])[0]
            if pol is not None:
                pol.saw_top1(float(q.max()))
                # sampled: decided before the draw (adaptive.draw_value); greedy: the argmax's own value
                v = pol.value(value, float(q[tok])) if st.sampling.greedy else pol.draw_value(value, q, q)
                if not pol.worth(v, ahead=self.nodes - i - 1):
                    break
                pol.add(v)
                value = v
            if not st.sampling.greedy:
                tok = sample(q, st.gen)
                qs.append(q)
            if pol is not None:
                probs.append(float(q[tok]))
            drafts.append(tok)
            if i == self.nodes - 1 or (pol is not None and not pol.worth_feeding([], [value], 1, ahead=self.nodes - i - 1)):
                break
            logits = yield from runner.extend([tok])
            fed += 1
            if pol is not None:
                pol.draft_forward(1)
        q_rows = None
        if qs:  # row 0 (the root) is never verified against q
            q_rows = torch.stack([torch.full_like(qs[0], float("nan"))] + qs)
        return drafts, q_rows, probs, len(pending), fed

    def step(self, st: DecodeState) -> Calls:
        if not st.will_draft():
            return (yield from st.ar_step())
        t0 = time.perf_counter()
        f0 = st.draft.forwards
        drafts, q_rows, probs, pending, fed = yield from self.draft(st)
        st.draft_seconds = time.perf_counter() - t0
        node_q = np.array([np.nan] + probs) if st.policy is not None else None
        emitted, _ = yield from st.verify_and_commit(TokenTree.chain(st.root, drafts, q_rows), st.draft.forwards - f0,
                                                     node_q=node_q)
        accepted = len(emitted) - 1
        # Keep the draft rows of pending tokens + accepted drafts whose KV exists (not the last one).
        st.draft.cache.commit(range(pending + min(accepted, fed)))
        return emitted
