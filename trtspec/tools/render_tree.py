"""Draw one speculative-decoding step's token tree, with the accepted path highlighted.

The input is the dict the runtime records per target step (`record_trees=True`, see
runtime/step.py `verify_and_commit`): tokens, parents (-1 for the root, node 0; parents precede children), the accepted
path (node indices, root first), the target's own next token, and optionally per-node `borrowed`
(GSD: reached through a merged edge, drawn dashed) and `reviewed` (n-gram proposal reviewed by the draft).

Layout is left-to-right: depth along x (token labels are wide, depths are few), one row per leaf, each
parent centred over its children. Pure matplotlib, no graphviz.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

import numpy as np

COL_IN, ROW_IN = 1.25, 0.34                   # inches per depth level / per leaf row
MARGIN_IN = dict(left=0.35, right=0.35, top=0.75, bottom=0.65)
MIN_W_IN, MIN_H_IN = 9.0, 2.4                 # room for the legend and title on tiny trees
ACCEPT, ACCEPT_FILL = "#1d4ed8", "#dbe7ff"
MUTED, MUTED_FILL, MUTED_TEXT = "#9ca3af", "#f6f7f9", "#4b5563"
BONUS, BONUS_FILL = "#15803d", "#d9f7e3"
REVIEWED_FILL = "#ffe8b3"


def token_label(tok: int, decode: Callable[[int], str] | None = None, width: int = 12) -> str:
    """Readable text of one token: newline ↵, tab ⇥, space · (5+ as ·×N), controls escaped; id as fallback."""
    try:
        text = decode(tok) if decode is not None else None
    except Exception:  # a decoder that cannot handle this id: show the id
        text = None
    if not text or set(text) == {"\ufffd"}:  # nothing, or only part of a UTF-8 character
        return str(tok)
    text = re.sub(r" {5,}", lambda m: f"·×{len(m.group())}", text)  # long indents stay countable
    text = text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "·")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def tree_layout(parents) -> tuple[np.ndarray, np.ndarray]:
    """(depth, row) of every node: leaves on consecutive rows in DFS order, parents centred over children.

    `parents[i] < i` for every non-root node (node 0 is the root), so children can be ordered by index."""
    parents = np.asarray(parents, dtype=np.int64)
    n = len(parents)
    depth = np.zeros(n, dtype=np.int64)
    for i in range(1, n):  # parents precede children: one pass
        depth[i] = depth[parents[i]] + 1
    children = [[] for _ in range(n)]
    for i in range(1, n):
        children[parents[i]].append(i)
    row = np.full(n, np.nan)
    stack, next_row = [0], 0
    while stack:  # pre-order DFS, first child on top
        i = stack.pop()
        if not children[i]:
            row[i], next_row = next_row, next_row + 1
        stack.extend(reversed(children[i]))
    lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
    for d in range(int(depth.max()), 0, -1):  # bottom-up, one vectorised step per level
        idx = np.flatnonzero(depth == d)
        np.minimum.at(lo, parents[idx], row[idx])
        np.maximum.at(hi, parents[idx], row[idx])
        p = np.unique(parents[idx])
        row[p] = (lo[p] + hi[p]) / 2
    return depth, row


def figure_size(n_cols: int, n_rows: int) -> tuple[float, float]:
    """Figure (width, height) in inches for a layout of `n_cols` depth levels and `n_rows` leaf rows."""
    m = MARGIN_IN
    return (max(MIN_W_IN, n_cols * COL_IN + m["left"] + m["right"]),
            max(MIN_H_IN, n_rows * ROW_IN + m["top"] + m["bottom"]))


def render_tree(tree: dict, path: str | Path, decode: Callable[[int], str] | None = None,
                title: str = "") -> Path:
    """Render `tree` (one recorded step) to `path`; the format follows the suffix (.png or .svg)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"render_tree: unsupported file type {path.suffix or '(none)'!r} for {path}; "
                         "use a .png or .svg file name")
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    tokens = list(tree["tokens"])
    n = len(tokens)
    acc = [int(i) for i in tree["path"]]
    if len(tree["parents"]) != n or not acc or acc[0] != 0:
        raise ValueError(f"render_tree: malformed tree ({n} tokens, {len(tree['parents'])} parents, path {acc})")
    # the target's own token hangs off the last accepted node as an extra (bonus / correction) node
    parents = np.append(np.asarray(tree["parents"], dtype=np.int64), acc[-1])
    parents[0] = -1
    tokens.append(int(tree["next_token"]))

    def node_flags(key: str) -> np.ndarray:
        flags = tree.get(key)
        return np.append(np.zeros(n, dtype=bool) if flags is None else np.asarray(flags, dtype=bool), False)

    borrowed, reviewed = node_flags("borrowed"), node_flags("reviewed")
    on_path = np.zeros(n + 1, dtype=bool)
    on_path[acc] = True
    bonus = np.arange(n + 1) == n

    depth, row = tree_layout(parents)
    n_cols, n_rows = int(depth.max()) + 1, int(row.max()) + 1
    (w, h), m = figure_size(n_cols, n_rows), MARGIN_IN
    aw, ah = w - m["left"] - m["right"], h - m["top"] - m["bottom"]
    fig = Figure(figsize=(w, h))  # no pyplot: no backend or global state involved
    ax = fig.add_axes((m["left"] / w, m["bottom"] / h, aw / w, ah / h))
    ax.set_xlim((n_cols - 1 - aw / COL_IN) / 2, (n_cols - 1 + aw / COL_IN) / 2)  # tree centred when the
    ax.set_ylim((n_rows - 1 + ah / ROW_IN) / 2, (n_rows - 1 - ah / ROW_IN) / 2)  # minimum size is larger
    ax.axis("off")

    # edges: smooth S-curves centre to centre (leaving and arriving level), under the opaque boxes
    kids = np.arange(1, n + 1)
    t = np.linspace(0, 1, 24)
    x0, y0, x1, y1 = depth[parents[kids]], row[parents[kids]], depth[kids], row[kids]
    seg = np.stack([x0[:, None] + np.outer(x1 - x0, t),
                    y0[:, None] + np.outer(y1 - y0, t * t * (3 - 2 * t))], -1)  # (edges, 24, 2)
    for mask, color, lw, style, z in (
            (~on_path[kids] & ~bonus[kids] & ~borrowed[kids], MUTED, 0.9, "solid", 1),
            (~on_path[kids] & borrowed[kids], MUTED, 0.9, (0, (3, 2)), 1),
            (on_path[kids] & ~borrowed[kids], ACCEPT, 2.4, "solid", 2),
            (on_path[kids] & borrowed[kids], ACCEPT, 2.4, (0, (3, 1.5)), 2),
            (bonus[kids], BONUS, 2.4, "solid", 2)):
        if mask.any():
            ax.add_collection(LineCollection(seg[mask], colors=color, linewidths=lw, linestyles=style, zorder=z))

    # nodes: fill says kind (reviewed / bonus), border says accepted, dashed border says merged
    for i in range(n + 1):
        label = token_label(tokens[i], decode)
        label = f"+ {label}" if bonus[i] else f" {label} " if len(label) <= 2 else label  # no slivers
        fill = BONUS_FILL if bonus[i] else REVIEWED_FILL if reviewed[i] else ACCEPT_FILL if on_path[i] else MUTED_FILL
        edge = BONUS if bonus[i] else ACCEPT if on_path[i] else MUTED
        strong = on_path[i] or bonus[i]
        ax.text(depth[i], row[i], label, ha="center", va="center", family="DejaVu Sans", fontsize=9.5,
                color="#111827" if strong else MUTED_TEXT, fontweight="bold" if strong else "normal", zorder=3,
                bbox=dict(boxstyle="round,pad=0.28", fc=fill, ec=edge, lw=1.8 if strong else 0.8,
                          ls="--" if borrowed[i] else "-"))

    n_acc = len(acc) - 1
    stats = (f"{n} nodes · depth {int(depth[:n].max())} · accepted {n_acc} draft token{'s' * (n_acc != 1)}"
             f" + 1 from the target = {n_acc + 1} emitted")
    fig.text(0.5, 1 - 0.12 / h, title or "speculative decoding step", ha="center", va="top",
             fontsize=11.5, fontweight="bold")
    fig.text(0.5, 1 - 0.38 / h, stats, ha="center", va="top", fontsize=9, color="#374151")
    handles = [Patch(fc=ACCEPT_FILL, ec=ACCEPT, lw=1.8, label="accepted"),
               Patch(fc=MUTED_FILL, ec=MUTED, lw=0.8, label="rejected"),
               Patch(fc=BONUS_FILL, ec=BONUS, lw=1.8, label="target's bonus / correction"),
               Line2D([], [], color=MUTED, lw=1.2, ls=(0, (3, 2)), label="merged / borrowed"),
               Patch(fc=REVIEWED_FILL, ec=MUTED, lw=0.8, label="n-gram, reviewed")]
    fig.legend(handles=handles, loc="lower center", ncol=5, frameon=False, fontsize=9.5,
               bbox_to_anchor=(0.5, 0.08 / h), handlelength=1.6, columnspacing=1.4)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, facecolor="white")
    return path
