"""The tree of cached prefixes at one frame: the empty prefix on the left, each node where its prefix ends (x: token
position), a tidy layout with elbow edges; a node's colour is its state, a red cross marks a node no request can
reach (its parent evicted). A node is one block (hash policy), a run of blocks (radix policy) or a stored block (an
engine's event stream); thousands of nodes stay a few traces.
"""

from __future__ import annotations

import numpy as np

from ..prefix.frames import STATES, PoolFrame, TreeNode
from .palette import BLOCK_COLOURS
from .prefix_words import label, tokens_hover
from .spec import FigureSpec

LABELLED = 40  # trees up to this many nodes show each node's first characters beside it


def end(node: TreeNode) -> int:
    """The token position where ``node``'s prefix ends (its x)."""
    return node.start + len(node.tokens)


def edges(frame: PoolFrame) -> list[tuple[str | None, str]]:
    """Every edge drawn, (parent id, child id); None is the empty prefix. A node whose parent was evicted has none."""
    ids = {n.id for n in frame.tree}
    return [(n.parent, n.id) for n in frame.tree if n.parent is None or n.parent in ids]


def layout_rows(frame: PoolFrame) -> dict[str, float]:
    """Each node's row: leaves 0, 1, 2, ... in depth-first order (children in the frame's order), a parent midway
    between its first and last child. Iterative: a chain of thousands of blocks is thousands deep."""
    ids = {n.id for n in frame.tree}
    children: dict[str | None, list[str]] = {}
    for n in frame.tree:
        children.setdefault(n.parent if n.parent in ids else None, []).append(n.id)
    rows: dict[str, float] = {}
    leaf = 0
    stack: list[tuple[str, bool]] = [(c, False) for c in reversed(children.get(None, []))]
    while stack:
        node, done = stack.pop()
        kids = children.get(node, [])
        if done or not kids:
            if kids:
                rows[node] = (rows[kids[0]] + rows[kids[-1]]) / 2
            elif node not in rows:
                rows[node], leaf = float(leaf), leaf + 1
            continue
        if node in rows:  # a cycle in a malformed tree: drawn once
            continue
        rows[node] = -1.0  # on the way down
        stack.append((node, True))
        stack += [(c, False) for c in reversed(kids) if c not in rows]
    return rows


def _hover(n: TreeNode, who: str) -> str:
    slots = ", ".join(map(str, n.slots[:12])) + (" …" if len(n.slots) > 12 else "")
    lines = [f"<b>node {n.id}</b> · {n.state}",
             f"tokens {n.start}–{end(n) - 1} ({len(n.tokens)} tokens) · block{'s' if len(n.slots) != 1 else ''} "
             f"{slots or '—'}",
             f"hits: {n.hits} {who}{'s' if n.hits != 1 else ''} served from it",
             tokens_hover(n.tokens, n.text)]
    if not n.reachable:
        lines.append("<b>unreachable</b>: its parent was evicted, so no request's prefix leads here")
    return "<br>".join(lines)


def spec(frame: PoolFrame, height: int | None = None) -> FigureSpec:
    rows = layout_rows(frame)
    by_id = {n.id: n for n in frame.tree}
    top = [n.id for n in frame.tree if n.parent is None or n.parent not in by_id]
    root_y = (rows[top[0]] + rows[top[-1]]) / 2 if top else 0.0
    xs: list[float] = []
    ys: list[float] = []
    for parent, child in edges(frame):
        px, py = (0.0, root_y) if parent is None else (float(end(by_id[parent])), rows[parent])
        cx, cy = float(end(by_id[child])), rows[child]
        xs += [px, px, cx, np.nan]
        ys += [py, cy, cy, np.nan]
    many = len(frame.tree) > 400
    size = 6 if many else (10 if len(frame.tree) > LABELLED else 15)
    who = "batch" if frame.policy == "events" else "request"
    traces = [dict(type="scatter", name="edges", mode="lines", x=np.array(xs, dtype=np.float32),
                   y=np.array(ys, dtype=np.float32), line=dict(color="#999", width=1 if many else 1.5),
                   hoverinfo="skip", showlegend=False),
              dict(type="scatter", name="empty prefix", mode="markers+text", x=[0], y=[root_y], text=["∅"],
                   textposition="middle left", textfont=dict(size=14), showlegend=False,
                   marker=dict(size=size, color="#ffffff", line=dict(color="#333", width=1.5)),
                   hovertemplate="the empty prefix: every request starts here<extra></extra>")]
    labelled = len(frame.tree) <= LABELLED
    right = max((end(n) for n in frame.tree), default=frame.block_size)
    step = max((len(n.tokens) for n in frame.tree), default=frame.block_size) or 1
    chars = max(4, min(12, int(540 / max(1.0, right / step) / 7)))  # a label fits the room to the next node
    for state in STATES:  # every state has its trace, empty or not: frame to frame only the data changes
        nodes = [n for n in frame.tree if n.state == state]
        traces.append(dict(
            type="scatter", name=state, mode="markers+text" if labelled else "markers",
            x=np.array([end(n) for n in nodes], dtype=np.int32),
            y=np.array([rows[n.id] for n in nodes], dtype=np.float32),
            **(dict(text=[label(n.text, chars) for n in nodes], textfont=dict(size=11),
                    textposition=["top center" if (end(n) // step) % 2 else "bottom center" for n in nodes])
               if labelled else {}),
            hovertext=[_hover(n, who) for n in nodes], hoverinfo="text",
            marker=dict(size=size, color=BLOCK_COLOURS[state], line=dict(color="#333", width=1)),
            showlegend=True))
    lost = [n for n in frame.tree if not n.reachable]
    traces.append(dict(type="scatter", name="unreachable", mode="markers", x=np.array([end(n) for n in lost],
                                                                                       dtype=np.int32),
                       y=np.array([rows[n.id] for n in lost], dtype=np.float32), hoverinfo="skip",
                       marker=dict(symbol="x-thin-open", size=size + 8, color="#d62728", line=dict(width=3)),
                       showlegend=bool(lost)))
    leaves = max(1, int(max(rows.values(), default=0)) + 1)
    unit = "blocks" if frame.policy != "radix" else "runs of blocks"
    title = (f"tree of cached prefixes · {frame.policy} · {len(frame.tree)} nodes ({unit})"
             + (f" · <span style='color:#d62728'>{len(lost)} unreachable</span>" if lost else ""))
    layout = dict(
        title=dict(text=title, font=dict(size=15), x=0.01, xanchor="left", y=0.98, yanchor="top"),
        height=height or int(min(640, max(280, 30 * leaves + 150))), margin=dict(l=20, r=20, t=74, b=50),
        hovermode="closest", plot_bgcolor="#ffffff",
        legend=dict(orientation="h", x=0, y=1.02, yanchor="bottom", font=dict(size=12)),
        xaxis=dict(title=dict(text="token position where the prefix ends"), range=[-0.06 * right - 1,
                                                                                  1.06 * right + 1],
                   zeroline=False, showgrid=True, gridcolor="#eee",
                   **({"dtick": frame.block_size} if right <= 32 * frame.block_size else {})),
        yaxis=dict(visible=False, range=[leaves - 0.5, -0.7], autorange=False))
    if not frame.tree:
        layout["annotations"] = [dict(text="nothing cached yet", x=0.5, y=0.5, xref="paper", yref="paper",
                                      showarrow=False, font=dict(size=14, color="#666"))]
    return FigureSpec(traces, layout)
