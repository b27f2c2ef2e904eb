"""The step: one decoding step of one request, the same for every strategy.

    prepare (what the strategy's drafters need from a head, asked with the batch's other requests')
    -> propose (the strategy; when the budget's ar gate says no draft forward pays, only what the
    strategy can propose for free: a suffix tree, or the root alone, a plain ar step)
    -> the grammar's masks over the tree, nodes it forbids pruned (grammar.py), tokens it forces
    added (its drafter, drafters/forced.py; with a grammar only)
    -> one target forward over the tree -> each node's logits under the request's rules (logits.py:
    penalties of its own path, logit_bias, min_tokens, the grammar's mask) -> exact acceptance
    (verify.py, on the device, chosen with the phase's other requests' trees in one pass and read
    with theirs in one transfer: effects.check, effects.resolve) -> commit the accepted rows of
    the target cache and of the draft cache
    -> logprobs of the emitted tokens (when asked) -> report

It is a coroutine of model calls (runner.py), so the scheduler batches many requests' steps.
Verification and commits happen here only: a strategy proposes a tree and never touches a cache's
committed rows. Returns the emitted tokens (the accepted drafts, then the target's own next token).
"""
from __future__ import annotations

import time

import torch

from .decode import DecodeState, StepStats
from .drafters import Forced
from .effects import Calls, check
from .logits import shape, token_logprobs
from .proposal import SOURCES, Proposal
from .sampling import probs_from_logits

FORCED = Forced()                          # the grammar's forced tokens: every request under a grammar


def step(st: DecodeState, strategy) -> Calls:
    """One step of one request; returns the emitted tokens."""
    t0 = time.perf_counter()
    behind = st.n_tokens - st.draft.cache.length if st.draft is not None else 0     # the draft catches up
    yield from strategy.prepare(st)                  # a head's forward, batched with the phase's (heads.py)
    if st.budget.begin(st.target.cache.length, behind):
        proposal = yield from strategy.propose(st)
    else:
        proposal = strategy.free(st)
    return (yield from verify_and_commit(st, proposal, time.perf_counter() - t0))[0]


def verify_and_commit(st: DecodeState, proposal: Proposal, draft_s: float = 0.0) -> Calls:
    """One target forward over the proposal's tree, exact acceptance, both caches committed, the step's
    stats appended. Returns (emitted tokens, accepted path as tree node indices, root first)."""
    hooks = st.target.batcher.hooks
    hooks.section(st, "verify")
    try:
        return (yield from _verify_and_commit(st, proposal, draft_s))
    finally:
        hooks.section(st, "draft")


def _verify_and_commit(st: DecodeState, proposal: Proposal, draft_s: float) -> Calls:
    t0 = time.perf_counter()
    masks = None
    if st.grammar is not None:             # forbidden drafts pruned, forced tokens added (jump-forward)
        proposal, masks = st.grammar.fit(proposal)
        proposal, masks = FORCED.grow(st, proposal, masks, st.target.batcher.max_step - len(proposal.tree))
    tree = proposal.tree.to(st.target.engine.device)
    raw, hidden = yield from st.target.verify(tree, hidden=True)
    logits = shape(st, tree, raw, masks)
    # sampled: the target's token at the root is the keyed draw of position n_tokens (verify.drawn)
    scores, key = (logits, None) if st.sampling.greedy else (probs_from_logits(logits, st.sampling),
                                                             (st.seed, st.n_tokens))
    last, nxt = yield from check(tree, scores, key)             # chosen and read with the phase's others
    path = tree.path(last)
    st.target.cache.commit(path)
    if hidden is not None:                           # a target with hidden rows: the accepted path's
        st.hidden = hidden[torch.from_numpy(path)]
    if proposal.draft_rows is not None:
        st.draft.cache.commit(proposal.draft_commit(path))
    emitted = tree.host_tokens[path[1:]].tolist() + [nxt]
    if st.sampling.logprobs is not None:
        st.step_logprobs = token_logprobs(raw, path, emitted, st.sampling.logprobs)
    verify_s = time.perf_counter() - t0
    extra = dict(proposal.stats)
    extra.update({name: bool(flags[path].any()) for name, flags in proposal.path_flags.items()})
    if sources := proposal.sources(path):
        extra["sources"] = sources
    if st.record_trees:
        extra["tree"] = {"tokens": tree.host_tokens.tolist(), "parents": tree.host_parents.tolist(),
                         "path": path.tolist(), "next_token": nxt, **proposal.nodes}
        if proposal.source is not None:
            extra["tree"]["source"] = [SOURCES[i] for i in proposal.source.tolist()]    # drafters' names
    extra.update(st.budget.observe(proposal, path, len(emitted), draft_s + verify_s))
    st.steps.append(StepStats(len(tree), len(path) - 1, len(st.ledger.forwards), draft_s, verify_s, extra))
    return emitted, path
