"""Attention: where the newest token looks, the whole history of who attended where, and the GQA grouping.

Top: the current token's attention probabilities over the cache's physical slots for one layer and query head
(for the paged and sink caches the slot order is not the position order). Bottom left: query position x key
position for that layer/head, one row per token as it was processed (the prefill's rows, then one per step);
positions a strategy evicted read 0. Bottom right: which query heads read which KV head (grouped-query
attention), the chosen head highlighted.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..caches.layout import SharedLayout
from ..trace.records import StepRecord
from .palette import PROBABILITY_SCALE, SINK_SCALE
from .spec import FigureSpec, columns, hide_axes, slot_range

MAX_ROWS = 256  # history rows drawn (the most recent); older rows scroll out


def history_matrix(records: Sequence[StepRecord], layer: int, head: int,
                   max_rows: int = MAX_ROWS) -> tuple[list[int], np.ndarray]:
    """Rows (query positions) and their attention over key positions ``0..max`` for ``layer``/``head``: a float32
    array, the most recent ``max_rows`` rows.

    The prefill record gives a row per prompt token; every later record its last row (a step without a cache
    recomputes all rows, of which only the newest is new)."""
    picked: list[tuple[int, np.ndarray]] = []
    width = 0
    for r in reversed(records):  # newest first, until enough rows
        t = r.trace
        if t is None or not t.has_attention(layer):
            continue
        raw = t.attention_raw(layer)[:, t.heads.index(head)]  # (T, keys read) in the order attention read them
        cols = np.asarray(t.reads_of(layer))
        first = r.position - r.input_len
        chosen = range(raw.shape[0]) if r.is_prefill else [raw.shape[0] - 1]
        for i in reversed(chosen):
            row = np.zeros(cols.max() + 1, dtype=np.float32)
            row[cols] = raw[i].numpy()  # logical positions; evicted ones stay 0
            picked.append((first + i, row))
            if len(picked) == max_rows:
                break
        width = max(width, int(cols.max()) + 1)
        if len(picked) == max_rows:
            break
    picked.reverse()
    matrix = np.zeros((len(picked), width), dtype=np.float32)
    for i, (_, row) in enumerate(picked):
        matrix[i, : len(row)] = row
    return [q for q, _ in picked], matrix


def _physical_slots(t, layer: int):
    """The slot view attention of ``layer`` read from (a shared layer reads its source's), or None."""
    slots = t.slots_of(layer)
    if slots is not None and isinstance(slots.layout, SharedLayout):
        slots = t.slots_of(slots.layout.source)
    return slots if slots is not None and slots.positions else None


def spec(records: Sequence[StepRecord], layer: int, head: int, token_texts: Sequence[str] = (),
         gqa_groups: Sequence[Sequence[int]] = (), num_heads: int = 0, sinks: bool = False) -> FigureSpec:
    """``sinks``: the model has learned attention sinks (gpt-oss); their share of each row (what the keys do not
    get) is drawn as its own column, left of slot 0 and of key position 0."""
    last = records[-1] if records else None
    have = last is not None and last.trace is not None and last.trace.has_attention(layer)
    bar_x, bar_y, bar_text = [], [], []
    if have:
        t = last.trace
        slots = _physical_slots(t, layer)
        probs = (t.physical_attention(layer) if slots is not None else t.attention(layer))[-1, t.heads.index(head)]
        bar_y = probs.numpy()
        bar_x = list(range(len(bar_y)))
        positions = slots.positions if slots is not None else bar_x
        bar_text = [f"slot {s} · position {p} {_tok(p, token_texts)}" if p >= 0 else f"slot {s}: empty"
                    for s, p in enumerate(positions)]
    qpos, matrix = history_matrix(records, layer, head) if have else ([], np.zeros((0, 0), np.float32))
    kvh = len(gqa_groups)
    group_z = [[(2 if h == head else 1) if h in g else 0 for h in range(num_heads)] for g in gqa_groups]
    current = "" if last is None else f" · token {last.position - 1} {_tok(last.position - 1, token_texts)}"
    traces = [
        dict(type="bar", name="current", x=bar_x, y=bar_y, customdata=bar_text, marker=dict(color="#3182bd"),
             hovertemplate="%{customdata}<br>p = %{y:.4f}<extra></extra>", xaxis="x", yaxis="y"),
        dict(type="heatmap", name="history", **columns(matrix, _causal(qpos, matrix.shape[1]), rows=qpos),
             colorscale=PROBABILITY_SCALE, zmin=0, zmax=1, xaxis="x2", yaxis="y2",
             colorbar=dict(title=dict(text="p"), len=0.5, y=0, yanchor="bottom", x=0.62, xanchor="left", thickness=10),
             hovertemplate="query position %{y} → key position %{x}<br>p = %{z:.4f}<extra></extra>"),
        dict(type="heatmap", name="gqa", z=group_z, x=list(range(num_heads)), y=list(range(kvh)), zmin=0, zmax=2,
             colorscale=[[0, "#f7f7f7"], [0.5, "#9ecae1"], [1, "#e6550d"]], showscale=False, xgap=2, ygap=2,
             xaxis="x3", yaxis="y3", hovertemplate="query head %{x} reads KV head %{y}<extra></extra>"),
    ]
    if sinks and have:  # the learned sink: one more column of the softmax, which reads no value
        traces.append(dict(type="bar", name="sink", x=[-1], y=[max(0.0, 1.0 - float(np.sum(bar_y)))],
                           marker=dict(color="#e6550d"), xaxis="x", yaxis="y",
                           hovertemplate="learned sink: p = %{y:.4f} (reads no value)<extra></extra>"))
        traces.append(dict(type="heatmap", name="sink history", x=np.full(len(qpos), -1, dtype=np.int32),
                           y=np.asarray(qpos, dtype=np.int32), z=np.clip(1.0 - matrix.sum(1), 0, 1),
                           colorscale=SINK_SCALE, zmin=0, zmax=1, showscale=False, xaxis="x2", yaxis="y2",
                           hovertemplate="query position %{y} → learned sink<br>p = %{z:.4f}<extra></extra>"))
    bar_range = slot_range(len(bar_x), max((i for i, y in enumerate(bar_y) if y > 0), default=0))
    notes = []
    if sinks and have:
        bar_range[0] = -1.5
        notes.append(dict(text="sink", x=-1, y=1, xref="x", yref="paper", yanchor="bottom", showarrow=False,
                          font=dict(size=11, color="#e6550d")))
    layout = dict(
        height=620, margin=dict(l=60, r=10, t=50, b=40), showlegend=False,
        title=dict(text=f"attention · layer {layer} · query head {head} (reads KV head "
                        f"{next((g for g, hs in enumerate(gqa_groups) if head in hs), '?')}){current}",
                   font=dict(size=13)),
        xaxis=dict(domain=[0, 1], anchor="y", title=dict(text="physical slot" + (" (-1: the learned sink)" if sinks
                                                                                  else ""), standoff=2),
                   range=bar_range),
        yaxis=dict(domain=[0.68, 1], anchor="x", title=dict(text="p (now)"), rangemode="tozero"),
        xaxis2=dict(domain=[0, 0.6], anchor="y2", title=dict(text="key position", standoff=2)),
        yaxis2=dict(domain=[0, 0.5], anchor="x2", title=dict(text="query position"), autorange="reversed"),
        xaxis3=dict(domain=[0.86, 1], anchor="y3", title=dict(text="query head"), dtick=1),
        yaxis3=dict(domain=[0, 0.5], anchor="x3", title=dict(text="KV head"), dtick=1, autorange="reversed"),
        annotations=notes if have else [dict(text="no attention captured yet", xref="paper", yref="paper", x=0.5,
                                          y=0.8, showarrow=False)],
    )
    return FigureSpec(traces, layout if have else hide_axes(layout))


def _causal(qpos: Sequence[int], width: int) -> np.ndarray:
    """The cells a row can hold: query position q reads keys 0..q (the rest is never sent)."""
    return np.arange(width)[None, :] <= np.asarray(qpos, dtype=np.int64)[:, None]


def _tok(pos: int, token_texts: Sequence[str]) -> str:
    return repr(token_texts[pos]) if 0 <= pos < len(token_texts) else ""


def from_snapshot(s) -> FigureSpec:
    ln = s.lane
    c = s.config
    return spec(ln.history, s.layer, s.head, ln.detail.texts if ln.detail else (), c.gqa_groups, c.num_heads,
                c.attention_sinks)
