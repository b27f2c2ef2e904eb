"""The logical-order target engine (engines/logical_engine.py: `exactness: logical`) end to end on a
tiny random-weight model, its Triton kernel on the CPU under TRITON_INTERPRET=1 (slow: the
interpreter runs each program in numpy, ~1 s a forward here).

Exactness in the model's own dtype, bf16: every node of random trees at random cached lengths has
the logits of the same path fed one token per forward, bit for bit, while the same engine form with
attention as it lies (`fixed`: the pool's rows in physical order, masked) differs on most nodes; the
logits match the eager torch engine's; and strategies give `ar`'s output alone and batched.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from trtspec.engines.logical_engine import LogicalTorchEngine  # noqa: E402
from trtspec.engines.torch_engine import TorchEngine  # noqa: E402
from trtspec.export.tiny import tiny_pair, tiny_spec  # noqa: E402
from trtspec.runtime.generator import Generator  # noqa: E402
from trtspec.tools.inspect_engines import TREE_ROOM, count_differences  # noqa: E402

pytestmark = pytest.mark.slow
LONGEST = 40
BUCKETS = {"tokens": [16], "cache": [LONGEST + TREE_ROOM]}


@pytest.fixture(scope="module")
def pair():
    return tiny_pair(tiny_spec("llama"), seed=0, dtype=torch.bfloat16)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tree_rows_equal_one_token_rows_in_bf16(arch):
    """Gemma 3 (windowed layers of 12 keys beside global ones): trees at 16-40 cached cross the window."""
    target, _ = tiny_pair(tiny_spec(arch), seed=0, dtype=torch.bfloat16)
    differ, nodes, worst, run = count_differences(LogicalTorchEngine(target), target.spec.vocab_size, 4, LONGEST,
                                                  seed=1, buckets=BUCKETS)
    assert run == 4 and nodes > 20 and differ == 0, (differ, nodes, worst)
    fixed = TorchEngine(target)                          # one shape, the same flags; attention as rows lie
    fixed.fixed_rows = fixed.exact = True
    differ, nodes, worst, _ = count_differences(fixed, target.spec.vocab_size, 4, LONGEST, seed=1, buckets=BUCKETS)
    assert differ > nodes // 2, (differ, nodes)          # the check is one an engine fails


def test_logits_match_the_eager_engine(pair):
    """A prompt's logits against the fp32 model's: no further off than the eager bf16 engine's."""
    target, _ = pair
    prompt = torch.randint(0, target.spec.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(1, 12, 12, dtype=torch.bool).tril()

    def logits(engine):
        return engine.step_batch([engine.new_cache(64)], prompt, torch.arange(12)[None], mask,
                                 torch.arange(12)[None]).clone()
    ref = logits(TorchEngine(copy.deepcopy(target).float()))
    ours, eager = (logits(e(target)) - ref for e in (LogicalTorchEngine, TorchEngine))
    assert ours.abs().max() <= 1.5 * eager.abs().max() + 1e-3, (ours.abs().max(), eager.abs().max())


def test_strategies_equal_ar_alone_and_batched(pair):
    target, draft = pair
    gen = Generator(LogicalTorchEngine(target), TorchEngine(draft), capacity=LONGEST + TREE_ROOM, buckets=BUCKETS,
                    slots=2)
    try:
        prompts = [[5, 9, 17, 33, 2], [7, 1, 300, 42, 42, 8, 11]]
        refs = [gen.generate(p, strategy="ar", max_new_tokens=6).token_ids for p in prompts]
        for s in ("chain:k=3", "staged:budget=15:stage2=false"):
            assert [gen.generate(p, strategy=s, max_new_tokens=6).token_ids for p in prompts] == refs, s
        handles = [gen.submit(p, strategy=s, max_new_tokens=6) for p, s in zip(prompts, ("staged:budget=15:stage2=false", "ar"))]
        assert [h.result(timeout=600).token_ids for h in handles] == refs
    finally:
        gen.close()
