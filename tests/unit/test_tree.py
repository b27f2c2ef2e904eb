"""TokenTree bookkeeping (depth, ancestor mask, path, children) against naive per-node walks."""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as hst

from trtspec.runtime.tree import TokenTree

SETTINGS = settings(max_examples=150, deadline=None, database=None)


@hst.composite
def parent_arrays(draw, max_nodes: int = 40) -> list[int]:
    """Random topologically ordered trees: parents[0] = -1, 0 <= parents[i] < i."""
    n = draw(hst.integers(1, max_nodes))
    shape = draw(hst.sampled_from(["uniform", "deep", "wide"]))
    parents = [-1]
    for i in range(1, n):
        lo, hi = 0, i - 1
        if shape == "deep":          # mostly chains: exercise many pointer-jumping rounds
            lo = max(0, i - 2)
        elif shape == "wide":        # children of the root or of node 1 only
            hi = min(i - 1, 1)
        parents.append(draw(hst.integers(lo, hi)))
    return parents


def naive_ancestors(parents: list[int], node: int) -> list[int]:
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]   # root .. node


def make_tree(parents: list[int]) -> TokenTree:
    n = len(parents)
    return TokenTree(torch.arange(100, 100 + n, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))


@SETTINGS
@given(parent_arrays())
def test_depth_and_ancestors_match_naive_walk(parents):
    tree = make_tree(parents)
    n = len(parents)
    assert tree.ancestors.shape == (n, n) and tree.ancestors.dtype == torch.bool
    assert tree.depth.dtype == torch.int64
    for i in range(n):
        anc = naive_ancestors(parents, i)
        assert int(tree.depth[i]) == len(anc) - 1
        expected = torch.zeros(n, dtype=torch.bool)
        expected[anc] = True
        assert torch.equal(tree.ancestors[i], expected), (parents, i)
    # Topological order: the mask is lower triangular with a true diagonal.
    assert torch.equal(tree.ancestors, tree.ancestors.tril())
    assert bool(tree.ancestors.diagonal().all())
    # The tree's parents tensor is not mutated by the construction.
    assert tree.parents.tolist() == parents


@SETTINGS
@given(parent_arrays())
def test_path_is_root_to_node_ascending(parents):
    tree = make_tree(parents)
    for i in range(len(parents)):
        p = tree.path(i)
        assert p.dtype == np.int64                       # a host array: no device read
        assert p.tolist() == naive_ancestors(parents, i)
        assert p[0] == 0 and p[-1] == i
        assert len(p) == int(tree.depth[i]) + 1


@SETTINGS
@given(parent_arrays())
def test_children_in_node_order(parents):
    tree = make_tree(parents)
    kids = tree.children()
    assert len(kids) == len(parents)
    for node, ks in enumerate(kids):
        assert ks == [c for c in range(len(parents)) if parents[c] == node]
        assert ks == sorted(ks)
    assert sorted(c for ks in kids for c in ks) == list(range(1, len(parents)))


def test_single_node_tree():
    tree = TokenTree(torch.tensor([7]), torch.tensor([-1]))
    assert len(tree) == 1
    assert tree.depth.tolist() == [0]
    assert tree.ancestors.tolist() == [[True]]
    assert tree.path(0).tolist() == [0]
    assert tree.children() == [[]]


def test_chain_constructor():
    q = torch.rand(4, 10)
    tree = TokenTree.chain(5, [1, 2, 3], q)
    assert tree.tokens.tolist() == [5, 1, 2, 3]
    assert tree.parents.tolist() == [-1, 0, 1, 2]
    assert tree.depth.tolist() == [0, 1, 2, 3]
    assert torch.equal(tree.ancestors, torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree.children() == [[1], [2], [3], []]
    assert tree.q is q
    assert TokenTree.chain(5, []).tokens.tolist() == [5]
    assert TokenTree.chain(5, []).q is None


def test_hand_built_branching_tree():
    #        0
    #      / | \
    #     1  2  5
    #    / \    |
    #   3   4   6
    parents = [-1, 0, 0, 1, 1, 0, 5]
    tree = make_tree(parents)
    assert tree.depth.tolist() == [0, 1, 1, 2, 2, 1, 2]
    assert tree.children() == [[1, 2, 5], [3, 4], [], [], [], [6], []]
    assert tree.path(4).tolist() == [0, 1, 4]
    assert tree.path(6).tolist() == [0, 5, 6]
    assert tree.ancestors[6].nonzero().flatten().tolist() == [0, 5, 6]
