"""render_tree: one recorded speculative-decoding step drawn to PNG / SVG (pure matplotlib)."""
import matplotlib.image as mpimg
import numpy as np
import pytest

from trtspec.tools.render_tree import figure_size, render_tree, token_label, tree_layout

VOCAB = ["def", " fib", "(", "n", "):", "\n", "    ", "if", " <", " 2", "\t", "\x00"]

# root 0 -> 1 -> 3 -> 6 accepted; 2 borrowed (merged edge), 4 and 5 reviewed n-gram proposals
TREE = {"tokens": [0, 1, 7, 2, 8, 9, 3, 5], "parents": [-1, 0, 0, 1, 1, 2, 3, 3],
        "path": [0, 1, 3, 6], "next_token": 4,
        "borrowed": [False, False, True, False, False, True, False, False],
        "reviewed": [False, False, False, False, True, True, False, False]}


def _png_shape(path):
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[0] > 50 and img.shape[1] > 50
    return img.shape[:2]


def test_all_node_kinds_png_and_svg(tmp_path):
    png = render_tree(TREE, tmp_path / "t.png", decode=lambda t: VOCAB[t], title="gsd: step 0")
    svg = render_tree(TREE, str(tmp_path / "sub" / "t.svg"), decode=lambda t: VOCAB[t])
    assert png.stat().st_size > 0 and svg.stat().st_size > 0
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    h, w = _png_shape(png)
    depth, row = tree_layout(TREE["parents"] + [TREE["path"][-1]])  # + the bonus node
    fw, fh = figure_size(depth.max() + 1, int(row.max()) + 1)
    assert w / h == pytest.approx(fw / fh, rel=0.02)


def test_layout_is_tidy():
    depth, row = tree_layout(TREE["parents"])
    assert depth.tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    leaves = [4, 6, 7, 5]  # DFS order, one row each
    assert sorted(row[leaves].tolist()) == [0, 1, 2, 3]
    assert row[3] == (row[6] + row[7]) / 2 and row[0] == (row[1] + row[2]) / 2


def test_root_only(tmp_path):
    tree = {"tokens": [5], "parents": [-1], "path": [0], "next_token": 3}
    _png_shape(render_tree(tree, tmp_path / "root.png"))


def test_chain_is_wide(tmp_path):
    n = 20
    tree = {"tokens": list(range(n)), "parents": list(range(-1, n - 1)), "path": list(range(12)), "next_token": 1}
    h, w = _png_shape(render_tree(tree, tmp_path / "chain.png", decode=lambda t: f"tok{t}"))
    assert w > 5 * h


def test_wide_tree_is_tall(tmp_path):
    rng = np.random.default_rng(0)
    parents = [-1] + [int(rng.integers(0, max(1, i // 4))) for i in range(1, 60)]
    tree = {"tokens": list(range(60)), "parents": parents, "path": [0, 1], "next_token": 7,
            "reviewed": (rng.random(60) < 0.2).tolist()}
    h, w = _png_shape(render_tree(tree, tmp_path / "wide.png"))
    assert h > w


def test_bad_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        render_tree(TREE, tmp_path / "t.jpg")
    with pytest.raises(ValueError, match="unsupported"):
        render_tree(TREE, tmp_path / "noext")


def test_token_label():
    assert token_label(5, lambda t: "\n") == "↵"
    assert token_label(5, lambda t: " a\tb") == "·a⇥b"
    assert token_label(5, lambda t: "\x00") == "\\x00"
    assert token_label(5, lambda t: "x" * 30) == "x" * 11 + "…"
    assert token_label(5, lambda t: "\n" + " " * 12) == "↵·×12"
    assert token_label(5, lambda t: "\ufffd") == "5"
    assert token_label(42) == "42" and token_label(42, lambda t: "") == "42"
    assert token_label(42, lambda t: VOCAB[t]) == "42"  # decoder error: fall back to the id
