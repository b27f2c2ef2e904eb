"""Tree attention by logical order (engines/logical_attention.py), on the CPU under TRITON_INTERPRET=1.

The interpreter runs the kernel's arithmetic in the kernel's order: a tree node's row must equal,
bit for bit, the same token's one-token row (its path laid out as sequential decoding leaves it:
prefix, then the path, contiguous), in bf16 KV, whatever shares the forward; it must agree with a
float64 reference; and the kernel people write (rows as they lie, the others masked in place) must
differ somewhere, so the equality is something a kernel can fail. The GPU run (lab/device_check)
confirms it on the hardware.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported: kernels run on the CPU
pytest.importorskip("triton")
pytestmark = pytest.mark.slow              # the interpreter runs each program in numpy: ~30 s here

from trtspec.engines.logical_attention import logical_attention  # noqa: E402

CHUNK, SPLIT, TAIL = 16, 64, 16            # small blocks, so the cases cross chunk and split edges
CAP, HKV, D = 256, 2, 32
# committed lengths at and around chunk (16) and split (64) edges, and one past two splits
PREFIXES = (1, 15, 17, 63, 64, 65, 150)


def _path(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out[::-1]


def _random_trees(seed: int) -> list[tuple[int, list[int]]]:
    """(committed length, parents) per tree: one random tree of 4..16 nodes per length in PREFIXES."""
    rng = np.random.default_rng(seed)
    return [(c, [-1] + [int(rng.integers(0, i)) for i in range(1, int(rng.integers(4, TAIL + 1)))])
            for c in PREFIXES]


def _cases(g: int, seed: int = 0, trees: list[tuple[int, list[int]]] | None = None):
    """A pool with each tree (slot j: the prefix, then the step's new rows as they lie) and, for
    every node, its sequential layout (its own slot: prefix, then its path)."""
    gen = torch.Generator().manual_seed(seed)
    trees = trees or _random_trees(seed)
    slots = len(trees) + sum(len(p) for _, p in trees)
    k = torch.randn(slots, HKV, CAP, D, generator=gen).bfloat16()
    v = torch.randn(slots, HKV, CAP, D, generator=gen).bfloat16()
    rows, seq, free = [], [], len(trees)
    for j, (c, parents) in enumerate(trees):
        for i in range(len(parents)):
            path = _path(parents, i)
            rows.append((j, c, [c + a for a in path]))                 # the tree row: ancestors as they lie
            seq.append((free, c + len(path) - 1, [c + len(path) - 1]))  # the token alone: itself after its prefix
            free += 1
    _lay_out(k, v, rows, seq)
    q = torch.randn(len(rows), HKV * g, D, generator=gen).bfloat16()
    return k, v, q, rows, seq


def _lay_out(k, v, rows, seq) -> None:
    """Each node's sequential layout from its tree's slot: the prefix, then its path, contiguous."""
    for (slot, c, tail), (alone, _, _) in zip(rows, seq):
        for x in (k, v):
            x[alone, :, :c] = x[slot, :, :c]
            x[alone, :, c:c + len(tail)] = x[slot, :, tail]


def _inputs(rows):
    tail = torch.full((len(rows), TAIL), -1, dtype=torch.int32)
    for r, (_, _, t) in enumerate(rows):
        tail[r, :len(t)] = torch.tensor(t)
    return (torch.tensor([s for s, _, _ in rows], dtype=torch.int32), torch.tensor([c for _, c, _ in rows], dtype=torch.int32),
            tail, torch.tensor([len(t) for _, _, t in rows], dtype=torch.int32))


def _attend(q, k, v, rows, order="logical"):
    return logical_attention(q, k, v, *_inputs(rows), chunk=CHUNK, split=SPLIT, order=order)


@pytest.fixture(scope="module")
def case():
    g = 4                                      # grouped-query: four query heads per KV head
    k, v, q, rows, seq = _cases(g)
    return g, k, v, q, rows, seq, _attend(q, k, v, rows), _attend(q, k, v, seq)


def test_tree_rows_equal_one_token_rows_bit_for_bit(case):
    g, k, v, q, rows, seq, tree, alone = case
    differ = [r for r in range(len(rows)) if not torch.equal(tree[r], alone[r])]
    assert not differ, f"{len(differ)} of {len(rows)} tree rows differ from the same token alone: {differ[:10]}"


def test_a_row_is_its_own_whatever_shares_the_forward(case):
    """Each row alone (one-row forwards) and in reverse order: the same bits."""
    g, k, v, q, rows, seq, tree, alone = case
    for r in (0, len(rows) - 1):
        assert torch.equal(_attend(q[r:r + 1], k, v, rows[r:r + 1])[0], tree[r])
    back = _attend(q[:24].flip(0), k, v, rows[:24][::-1])
    assert torch.equal(back.flip(0), tree[:24])


def test_equals_a_float64_reference(case):
    g, k, v, q, rows, seq, tree, alone = case
    worst = 0.0
    for r, (slot, c, tail) in enumerate(rows):
        keys = list(range(c)) + tail
        for h in range(q.shape[1]):
            kk, vv = k[slot, h // g, keys].double(), v[slot, h // g, keys].double()
            ref = torch.softmax(kk @ q[r, h].double() / D ** 0.5, 0) @ vv
            worst = max(worst, (tree[r, h].double() - ref).abs().max().item())
    assert worst < 2e-2, worst             # the output's own bf16 rounding: 2^-8 of values near 1


def test_the_kernel_people_write_differs():
    """The same kernel over the step's rows as they lie (the others masked in place) is not the
    one-token arithmetic: where a node's ancestors lie across a chunk edge that its logical positions
    do not cross, the running maximum moves at another chunk, and its rescaling rounds otherwise. Star
    trees (every node a child of the root) after 10 and 40 committed rows: node i lies at c + i, its
    logical place is c + 1; each node's key is drawn near its query, so it is often its row's
    largest. Some rows must differ (the equality above is one a kernel can fail), all stay close."""
    trees = [(10, [-1] + [0] * 15), (40, [-1] + [0] * 15)]
    k, v, q, rows, seq = _cases(1, seed=2, trees=trees)
    for r, (slot, c, tail) in enumerate(rows):
        k[slot, :, tail[-1]] = (q[r].float() * 3).bfloat16()          # the node's key: near its query
    _lay_out(k, v, rows, seq)
    physical, alone = _attend(q, k, v, rows, order="physical"), _attend(q, k, v, seq)
    assert torch.equal(_attend(q, k, v, rows), alone)                  # logical order: the same bits
    differ = sum(not torch.equal(physical[r], alone[r]) for r in range(len(rows)))
    assert differ > 0
    assert torch.allclose(physical.float(), alone.float(), atol=2e-2)   # close, not equal


def test_padding_rows_give_zeros_and_touch_nothing():
    k, v, q, rows, seq = _cases(2, seed=1)
    pad = [(0, 0, [])] * 3
    out = _attend(torch.cat([q[:2], q[:3]]), k, v, rows[:2] + pad)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.equal(out[:2], _attend(q[:2], k, v, rows[:2]))
