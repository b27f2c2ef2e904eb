"""chain: Leviathan/Chen speculative decoding with a draft model.

k draft tokens, one by one (greedy, or sampled with their q rows kept so acceptance stays exact),
then one target forward over the chain; the bonus token comes free when all k are accepted.
"""
from __future__ import annotations

import time

import torch

from ..decode import DecodeState
from ..runner import Calls
from ..sampling import sample
from ..tree import TokenTree
from ...options import TreeSize
from .base import Strategy


class ChainSpeculative(Strategy):
    """k draft-model tokens per target step."""
    name = "chain"
    needs_draft = True

    def __init__(self, k: TreeSize = 4):
        self.k = k

    def max_tree_size(self) -> int:
        return self.k + 1

    def max_draft_rows(self) -> int:
        return self.k - 1

    def draft(self, st: DecodeState) -> Calls:
        """Greedy or sampled chain from the draft model. Returns (drafts, q rows or None, pending).

        The draft cache may lag the sequence by a token or two (the bonus token, or the last draft
        whose KV was never computed), so the first call feeds every pending token with the root."""
        runner = st.draft
        pending = st.tokens()[runner.cache.length:].tolist()
        logits = yield from runner.extend(pending)
        drafts: list[int] = []
        qs = []
        for i in range(self.k):
            if st.sampling.greedy:
                tok = int(logits[-1].argmax())
            else:
                q = st.draft_probs(logits[-1:])[0]
                tok = sample(q, st.gen)
                qs.append(q)
            drafts.append(tok)
            if i < self.k - 1:
                logits = yield from runner.extend([tok])
        q_rows = None
        if qs:  # row 0 (the root) is never verified against q
            q_rows = torch.stack([torch.full_like(qs[0], float("nan"))] + qs)
        return drafts, q_rows, len(pending)

    def step(self, st: DecodeState) -> Calls:
        t0 = time.perf_counter()
        f0 = st.draft.forwards
        drafts, q_rows, pending = yield from self.draft(st)
        st.draft_seconds = time.perf_counter() - t0
        emitted, _ = yield from st.verify_and_commit(TokenTree.chain(st.root, drafts, q_rows), st.draft.forwards - f0)
        accepted = len(emitted) - 1
        # Keep the draft rows of pending tokens + accepted drafts whose KV exists (not the k-th).
        st.draft.cache.commit(range(pending + min(accepted, self.k - 1)))
        return emitted
