"""The draft model's constraints: its KV rows are reserved up front (refused before the first token,
never mid-stream), and a draft whose embedding table is smaller or larger than the target's still
gives the target's exact greedy output and sampled distribution.
"""
from __future__ import annotations



import numpy as np
import pytest
import torch

from conftest import reference_logits
from trtspec.engines.torch_engine import TorchEngine
from trtspec.export.model import Decoder
from trtspec.export.tiny import random_state, tiny_spec
from trtspec.runtime.generator import Generator
from trtspec.runtime.kv_cache import CapacityError
from trtspec.runtime.sampling import SamplingParams
from trtspec.runtime.strategies import GSD, STRATEGIES, Cascade, ChainSpeculative, DySpec, Staged

# ---------------------------------------------------------------------------------------------
# Draft KV is reserved: near the capacity, refused before the first token, never mid-stream
# ---------------------------------------------------------------------------------------------

DRAFT_HEAVY = [GSD(top_k=4, sibling_ratio=0.0, confidence=0.0, budget=6, max_draft_nodes=60, max_depth=8),
               Cascade(k_draft=5, k_mag=1, mag_len=8), DySpec("heap", budget=20, batch=5), Staged(budget=16)]


@pytest.mark.parametrize("strat", DRAFT_HEAVY, ids=lambda s: s.name)
def test_draft_rows_are_reserved(llama_pair, strat):
    prompt = [5, 9, 13, 5, 9, 13, 5, 9]
    n = 24
    exact = len(prompt) + n + strat.max_rows()
    gen = llama_pair.generator(capacity=exact)        # exactly enough: runs to the end
    ref = llama_pair.generator(capacity=256).generate(prompt, strategy="ar", max_new_tokens=n).token_ids
    assert gen.generate(prompt, strategy=strat, max_new_tokens=n).token_ids == ref
    small = llama_pair.generator(capacity=exact - 1)  # one row short: refused before any token
    it = small.iter_tokens(prompt, strategy=strat, max_new_tokens=n)
    with pytest.raises(CapacityError, match=f"draft {strat.max_draft_rows()}"):
        next(it)
    assert all(b.forwards == 0 for b in small.batchers.values())


# ---------------------------------------------------------------------------------------------
# A draft whose embedding table is smaller or larger than the target's
# ---------------------------------------------------------------------------------------------

def draft_with_vocab(target: Decoder, vocab: int, noise: float = 0.05, seed: int = 1) -> Decoder:
    """The target's weights, noised, with the embedding/head tables cut or extended to `vocab` rows."""
    spec = tiny_spec(vocab_size=vocab, num_layers=target.spec.num_layers)
    extra = random_state(spec, seed)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, v in target.state_dict().items():
        v = v.clone()
        if k in ("model.embed_tokens.weight", "lm_head.weight"):
            v = torch.cat([v, extra[k][v.shape[0]:]])[:vocab]
        state[k] = v + noise * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v
    return Decoder.from_state(spec, state, torch.float32)


@pytest.mark.parametrize("draft_vocab", [500, 530])
def test_draft_vocab_differs_greedy(llama_pair, draft_vocab):
    draft = draft_with_vocab(llama_pair.target, draft_vocab)
    gen = Generator(llama_pair.target_engine, TorchEngine(draft), capacity=256)
    prompt = [3, 17, 99, 250, 3, 17, 99]
    ref = gen.generate(prompt, strategy="ar", max_new_tokens=30).token_ids
    for name in STRATEGIES:
        assert gen.generate(prompt, strategy=name, max_new_tokens=30).token_ids == ref, name
    for name in ("chain", "dyspec"):     # sampled drafts: q rows in the target's vocabulary
        res = gen.generate(prompt, strategy=name, max_new_tokens=30, sampling=SamplingParams(1.0), seed=1)
        assert len(res.token_ids) == 30 and max(res.token_ids) < 512


@pytest.mark.parametrize("draft_vocab", [12, 20])
def test_draft_vocab_differs_sampling_exact(small_pair, draft_vocab):
    """Chain with sampled drafts from a 12- or 20-row draft over a 16-token target: the first
    token is still distributed as the target's (chi-square, as in test_sampling_exact)."""
    from test_sampling_exact import PASS_P, chisquare_p, reference_probs
    draft = draft_with_vocab(small_pair.target, draft_vocab, noise=0.15)
    gen = Generator(small_pair.target_engine, TorchEngine(draft), capacity=64)
    prompt, sp = [1, 2, 3, 4, 1, 2, 3], SamplingParams(1.0)
    p1 = reference_probs(reference_logits(small_pair.target, prompt)[-1], sp)
    counts = np.zeros(16)
    accepted = 0
    for i in range(1200):
        res = gen.generate(prompt, strategy=ChainSpeculative(2), max_new_tokens=1, sampling=sp, seed=i)
        counts[res.token_ids[0]] += 1
        accepted += res.steps[0].accepted
    pval = chisquare_p(counts, p1)
    print(f"[pvalue] draft vocab {draft_vocab}: {pval:.3g}, drafts accepted {accepted}")
    assert accepted > 100 and pval > PASS_P
