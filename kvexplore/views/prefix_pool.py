"""The block pool of a prefix cache at one frame: a grid of ``num_blocks`` cells (slot 0 top left, row by row), each
coloured by its state, its hover what the block holds and who stored and used it; the next blocks the free queue
gives are numbered and a diamond marks a state checkpoint (hybrid models). One heatmap whatever the pool's size; a
small pool also shows each block's first characters in its cell.
"""

from __future__ import annotations

import math

import numpy as np

from ..prefix.frames import STATES, PoolFrame
from .palette import BLOCK_COLOURS, discrete_colorscale
from .prefix_words import label, memory_words, tokens_hover
from .spec import FigureSpec, columns

NEXT_SHOWN = 8      # free-queue positions numbered on the grid
EXPLAINED = 512     # pools up to this many blocks say in each hover what the state means (the legend does too)
LABELLED = 128      # pools up to this many blocks (16 to a row) show each block's first characters in its cell
STATE_MEANING = {
    "free": "holds nothing reusable", "cached": "no request holds it; a later request may hit it",
    "hit": "this request found it in the cache (not recomputed)", "written": "this request computed it",
    "evicted": "dropped by this frame to make room", "held": "held by a request still running (or by the engine)",
}


def grid_columns(num_blocks: int) -> int:
    """Cells per row: about one and a half times as wide as tall, a multiple of 8 (8 for 24 blocks, 16 for 64,
    80 for 4,096)."""
    return max(8, 8 * math.ceil(math.sqrt(1.5 * max(num_blocks, 1)) / 8))


def cell(slot: int, cols: int) -> tuple[int, int]:
    return slot % cols, slot // cols


def _hover(frame: PoolFrame, b, queue_at: dict[int, int], reachable: dict[str, bool], who: str) -> str:
    if b.state == "free" and not b.tokens:  # (most of a big pool: kept short)
        return f"<b>slot {b.slot}</b> · free" + (" · in the free queue" if b.slot in queue_at else "")
    lines = [f"<b>slot {b.slot}</b> · {b.state}" + (f" (node {b.node})" if b.node else "")]
    if frame.num_blocks <= EXPLAINED:
        lines.append(STATE_MEANING.get(b.state, ""))
    if b.hash is not None:
        lines.append(f"hash {b.hash} ← " + (f"parent {b.parent}" if b.parent else "first block of its prefix"))
    lines.append(f"refcount {b.refcount}" + (f" · stored by {who} {b.stored_by}" if b.stored_by is not None else "")
                 + (f" · last used by {who} {b.last_used}" if b.last_used is not None else ""))
    if b.tokens:
        lines.append(tokens_hover(b.tokens, b.text))
    if b.state_checkpoint:
        lines.append("◆ state checkpoint: a recurrent state was saved at its end")
    if b.sliding_freed:
        lines.append("× the sliding-window layers freed their share (vLLM keeps it only where a request can resume)")
    if b.node is not None and not reachable.get(b.node, True):
        lines.append("unreachable: its parent was evicted, no request can get to it")
    if b.slot in queue_at:  # (not its place: that changes every frame for every block in the queue)
        lines.append("in the free queue: a request that needs a block may take it")
    return "<br>".join(lines)


def spec(frame: PoolFrame, height: int | None = None) -> FigureSpec:
    n = max(frame.num_blocks, 1 + max((b.slot for b in frame.blocks), default=-1))
    cols = grid_columns(n)
    rows = max(1, math.ceil(n / cols))
    who = "batch" if frame.policy == "events" else "request"
    code = {s: i for i, s in enumerate(STATES)}
    states = np.zeros(rows * cols, dtype=np.int8)
    keep = np.zeros(rows * cols, dtype=bool)
    by_slot = {b.slot: b for b in frame.blocks}
    for slot, b in by_slot.items():
        states[slot] = code[b.state]
    keep[:n] = True
    queue_at = {slot: i for i, slot in enumerate(frame.free_queue)}
    reachable = {node.id: node.reachable for node in frame.tree}
    cells = columns(states.reshape(rows, cols), keep.reshape(rows, cols))
    hover = [_hover(frame, by_slot[s], queue_at, reachable, who) if s in by_slot else f"<b>slot {s}</b> · free"
             for s in range(n)]
    gap = 2 if cols <= 64 else (1 if cols <= 128 else 0)
    traces = [dict(type="heatmap", name="blocks", **cells, text=hover, hovertemplate="%{text}<extra></extra>",
                   zmin=-0.5, zmax=len(STATES) - 0.5, showscale=False, xgap=gap, ygap=gap,
                   colorscale=discrete_colorscale(tuple(BLOCK_COLOURS[s] for s in STATES)))]
    if n <= LABELLED:
        shown = [b for b in frame.blocks if b.text and b.state != "free"]
        traces.append(dict(type="scatter", name="labels", mode="text", hoverinfo="skip", showlegend=False,
                           x=np.array([cell(b.slot, cols)[0] for b in shown], dtype=np.int32),
                           y=np.array([cell(b.slot, cols)[1] + 0.1 for b in shown], dtype=np.float32),  # (below
                           # the free queue's numbers)
                           text=[label(b.text, max(3, 48 // cols), 2) for b in shown],
                           textfont=dict(size=12, color="#111")))
    nxt = frame.free_queue[:NEXT_SHOWN]
    traces.append(dict(type="scatter", name="next free", mode="markers+text", showlegend=False,
                       x=np.array([cell(s, cols)[0] - 0.28 for s in nxt], dtype=np.float32),
                       y=np.array([cell(s, cols)[1] - 0.22 for s in nxt], dtype=np.float32),
                       text=[str(i + 1) for i in range(len(nxt))], textfont=dict(size=9, color="#111"),
                       marker=dict(symbol="circle", size=13, color="#ffffff", line=dict(color="#333", width=1)),
                       hovertemplate=[f"next free #{i + 1}: slot {s}"
                                      + (f" ({by_slot[s].state}: taking it drops its prefix)"
                                         if s in by_slot and by_slot[s].state == "cached" else "")
                                      + "<extra></extra>" for i, s in enumerate(nxt)]))
    marked = [b.slot for b in frame.blocks if b.state_checkpoint]
    traces.append(dict(type="scatter", name="state checkpoint", mode="markers", showlegend=bool(marked),
                       x=np.array([cell(s, cols)[0] + 0.3 for s in marked], dtype=np.float32),
                       y=np.array([cell(s, cols)[1] - 0.22 for s in marked], dtype=np.float32),
                       marker=dict(symbol="diamond", size=9, color="#222"), hoverinfo="skip"))
    freed = [b.slot for b in frame.blocks if b.sliding_freed]
    traces.append(dict(type="scatter", name="sliding layers freed", mode="markers", showlegend=bool(freed),
                       x=np.array([cell(s, cols)[0] + 0.3 for s in freed], dtype=np.float32),
                       y=np.array([cell(s, cols)[1] + 0.25 for s in freed], dtype=np.float32),
                       marker=dict(symbol="x-thin", size=8, color="#222", line=dict(color="#222", width=2)),
                       hoverinfo="skip"))
    # the legend: one square per state (a heatmap has none of its own)
    traces += [dict(type="scatter", name=s, x=[None], y=[None], mode="markers", hoverinfo="skip", showlegend=True,
                    marker=dict(symbol="square", size=12, color=BLOCK_COLOURS[s], line=dict(color="#999", width=1)))
               for s in STATES]
    counts = ", ".join(f"{frame.count(s)} {s}" for s in STATES if frame.count(s))
    queue = ", ".join(map(str, nxt)) + (" …" if len(frame.free_queue) > len(nxt) else "")
    memory = memory_words(frame, "<br>")  # (a line of its own: it would not fit beside the counts)
    title = (f"block pool · {frame.policy} · {n} blocks of {frame.block_size} tokens<br>"
             f"<span style='font-size:12px'>{counts or 'empty'} · next free: {queue or 'none'}{memory}</span>")
    cell_px = 46 if cols <= 8 else (34 if cols <= 16 else (20 if cols <= 48 else 11))
    layout = dict(
        title=dict(text=title, font=dict(size=15), x=0.01, xanchor="left"),
        height=height or int(min(640, max(240, rows * cell_px + 150))) + (16 if memory else 0),
        margin=dict(l=60, r=10, t=80 if memory else 64, b=40),
        hovermode="closest", plot_bgcolor="#ffffff",
        legend=dict(orientation="h", x=0, y=-0.02, yanchor="top", font=dict(size=12)),
        xaxis=dict(range=[-0.5, cols - 0.5], showgrid=False, zeroline=False, showticklabels=False),
        yaxis=dict(range=[rows - 0.5, -0.5], autorange=False, showgrid=False, zeroline=False,
                   tickvals=list(range(0, rows, max(1, rows // 8))),
                   ticktext=[f"slot {r * cols}" for r in range(0, rows, max(1, rows // 8))]))
    return FigureSpec(traces, layout)
