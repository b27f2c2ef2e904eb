"""The target's logits at every tree node, reshaped by a request's rules, and its logprobs.

Verification is exact when each node is scored as `ar` would score that position: with the
penalties of the node's own path (the committed tokens, then the tree's tokens from the root's child
down to the node), `min_tokens` counted at the node's depth, and the grammar's mask after the node's
path (grammar.py). `shape` does that for a whole tree at once; verification then reads the result as
it reads raw logits (greedy argmax, or probabilities after temperature / top-k / top-p).

Order (vLLM's): repetition penalty over prompt and output tokens (a seen token's logit is divided by
it when positive, multiplied when negative), frequency and presence penalties over output tokens
(logit -= frequency * count + presence * [count > 0]), logit_bias, the grammar's mask, then
min_tokens (stop tokens masked while fewer than min_tokens tokens precede the node's successor,
unless the grammar allows nothing else: the grammar wins).

Penalties touch only the columns of tokens that occur in the sequence or the tree, so the work is
[nodes, distinct tokens], not [nodes, vocabulary].

`token_logprobs` reports the target's own log-probabilities (log-softmax of its raw logits, before
any rule or temperature: vLLM's default `raw_logprobs`) of each emitted token, read at the node it
was drawn at, and the top alternatives.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .grammar import unpack
from .tree import TokenTree


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()      # the k most likely tokens at that position, best first


def shape(st, tree: TokenTree, logits: torch.Tensor, masks: np.ndarray | None = None) -> torch.Tensor:
    """The [N, V] logits of the tree's nodes under the request's rules (`st`: its DecodeState), or
    `logits` itself when no rule is set. `masks`: the grammar's int32 bitmask per node."""
    sp = st.sampling
    if not sp.shapes_logits:
        return logits
    x = logits.float().clone()
    if sp.penalized:
        _penalize(x, st, tree)
    if sp.logit_bias:
        ids, vals = zip(*sp.logit_bias)
        x[:, torch.tensor(ids, device=x.device)] += torch.tensor(vals, dtype=x.dtype, device=x.device)
    if masks is not None:
        x.masked_fill_(~torch.from_numpy(unpack(masks, x.shape[-1])).to(x.device), float("-inf"))
    if sp.min_tokens and st.stop_ids:
        early = (st.n_tokens - st.prompt_len) + tree.host_depth < sp.min_tokens
        if early.any():
            rows = torch.from_numpy(np.flatnonzero(early)).to(x.device)
            stops = torch.tensor(sorted(st.stop_ids), device=x.device)
            masked = x[rows].index_fill(-1, stops, float("-inf"))
            ok = torch.isfinite(masked).any(-1)          # a row with nothing left keeps its stop tokens
            x[rows[ok]] = masked[ok]
    return x


def _penalize(x: torch.Tensor, st, tree: TokenTree) -> None:
    """Repetition, frequency and presence penalties, each node by its own path (in place)."""
    sp = st.sampling
    hist = st.seq[:st.n_tokens]                      # prompt + output; the root is its last token
    out = hist[st.prompt_len:]
    toks = tree.host_tokens
    cand = np.unique(np.concatenate([hist, toks]))   # the only columns a penalty can touch
    k = len(cand)
    # on_path[i, c]: how often candidate c occurs on node i's path below the root (the root is in hist)
    below_root = np.zeros((len(tree) - 1, k))
    below_root[np.arange(len(tree) - 1), np.searchsorted(cand, toks[1:])] = 1.0
    on_path = tree.ancestors[:, 1:].cpu().numpy().astype(np.float64) @ below_root
    out_counts = torch.from_numpy(np.bincount(np.searchsorted(cand, out), minlength=k) + on_path)
    seen = torch.from_numpy((np.bincount(np.searchsorted(cand, hist), minlength=k) + on_path) > 0)
    idx = torch.from_numpy(cand).to(x.device)
    sub = x[:, idx]
    if sp.repetition_penalty != 1.0:
        r = sp.repetition_penalty
        sub = torch.where(seen.to(x.device), torch.where(sub > 0, sub / r, sub * r), sub)
    out_counts = out_counts.to(x.device, x.dtype)
    sub = sub - sp.frequency_penalty * out_counts - sp.presence_penalty * (out_counts > 0).to(x.dtype)
    x[:, idx] = sub


def token_logprobs(logits: torch.Tensor, path: np.ndarray, emitted: list[int], top: int) -> list[TokenLogprob]:
    """Each emitted token's log-probability under the target at the node it was drawn at (emitted[i]
    follows path[i]), with the `top` most likely tokens there."""
    rows = torch.log_softmax(logits[torch.from_numpy(path).to(logits.device)].float(), -1)
    chosen = rows.gather(1, torch.tensor(emitted, device=rows.device).unsqueeze(1))[:, 0].tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(emitted, chosen)]
    vals, ids = rows.topk(top, -1)
    return [TokenLogprob(t, lp, tuple(zip(i, v))) for t, lp, i, v in zip(emitted, chosen, ids.tolist(), vals.tolist())]
