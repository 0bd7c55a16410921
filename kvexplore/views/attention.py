"""Attention: where the newest token looks (its probabilities over the physical slots, binned by max when wider than
the figure), the whole history of query x key positions (binned to the screen by max, full resolution once zoomed
narrow enough, coloured from 0 to the 99th percentile of the cells drawn), and the GQA grouping (docs/explorer.md,
"Views"). An explorer lane's attention comes from its bounded store (a trace ``history`` declared ``bounded``: the
binned overview, the newest rows, rows recomputed on a zoom); a plain tracer's records hold every row and are binned
here the same way, to at most :data:`ROW_BINS` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..caches.layout import SharedLayout
from ..trace.records import StepRecord
from . import bins, onscreen
from .palette import PROBABILITY_SCALE, SINK_SCALE
from .snapshot import MAX_BINS
from .spec import FigureSpec, hide_axes, slot_range

ROW_BINS = 128  # query-row bins the history heatmap draws at most (the explorer's store keeps as many)


def history_matrix(records: Sequence[StepRecord], layer: int, head: int) -> np.ndarray:
    """The full history of ``layer``/``head`` from records that hold every row (a plain tracer's): ``(rows, keys)``
    float32, row ``q`` the attention of query position ``q`` over key positions ``0..q`` (0 where not read), NaN
    past ``q`` and for rows no record holds. The prefill record gives a row per prompt token; every later record its
    last row (a step without a cache recomputes all rows, of which only the newest is new)."""
    rows: dict[int, np.ndarray] = {}
    for r in records:
        t = r.trace
        if t is None or not t.has_attention(layer):
            continue
        raw = t.attention_raw(layer)[:, t.heads.index(head)].numpy()
        cols = np.asarray(list(t.reads_of(layer)), dtype=np.int64)
        first = r.position - r.input_len
        for i in (range(raw.shape[0]) if r.is_prefill else [raw.shape[0] - 1]):
            row = np.zeros(int(cols.max()) + 1, dtype=np.float32)
            row[cols] = raw[i]
            rows[first + i] = row
    n = max(rows, default=-1) + 1
    out = np.full((n, n), np.nan, dtype=np.float32)
    for q, row in rows.items():
        out[q, : q + 1] = 0.0
        w = min(len(row), q + 1)
        out[q, :w] = row[:w]
    return out


def _binned(full: np.ndarray, first_row: int, rb: bins.Bins, cb: bins.Bins) -> np.ndarray:
    """``full`` (rows from position ``first_row``, keys from 0; NaN: no cell) reduced to ``rb`` x ``cb`` by max."""
    cols = bins.reduce(full, cb, "max")  # (rows, nc)
    shifted = np.full((cols.shape[1], rb.start + rb.count * rb.size), np.nan, dtype=np.float32)
    take = slice(max(first_row, rb.start), min(first_row + cols.shape[0], shifted.shape[1]))
    shifted[:, take] = cols[take.start - first_row: take.stop - first_row].T
    return bins.reduce(shifted, rb, "max").T  # (nr, nc)


def _store(records: Sequence[StepRecord], source: Any) -> Any:
    """The lane's bounded store: ``source``'s, or the history of the records' traces when it is one (a replay of an
    explorer's run); None for a plain tracer's records (they hold every row)."""
    if source is not None:
        return source.store
    last = records[-1] if records else None
    h = last.trace.history if last is not None and last.trace is not None else None
    return h if h is not None and h.bounded else None


def _span(zoom: dict | None, axis: str, n: int) -> tuple[int, int]:
    """The index range ``[lo, hi)`` of ``0..n-1`` on screen along ``axis`` (all of it when not zoomed)."""
    r = (zoom or {}).get(axis)
    if not r:
        return 0, n
    lo, hi = sorted(float(v) for v in r)
    lo, hi = max(0, int(np.ceil(lo - 0.5))), min(n, int(np.floor(hi + 0.5)) + 1)
    return (lo, hi) if hi > lo else (0, n)


def _history(store, records, source, layer, head, rows_n, zoom, max_bins):
    """``(row bins, key bins, max per bin, sink share per row bin, note)`` of the history heatmap."""
    q_lo, q_hi = _span(zoom, "yaxis2", rows_n)
    k_lo, k_hi = _span(zoom, "xaxis2", rows_n)
    rb, cb = bins.plan(q_lo, q_hi, store.row_bins if store is not None else ROW_BINS), \
        bins.plan(k_lo, k_hi, min(max_bins, store.col_bins) if store is not None else max_bins)
    if store is None:
        full = history_matrix(records, layer, head)[:rows_n]
        seen = ~np.isnan(full).all(1)
        share = np.where(seen, np.clip(1 - np.nansum(full, 1), 0, 1), np.nan)[:, None]
        return rb, cb, _binned(full, 0, rb, cb), _binned(share, 0, rb, bins.plan(0, 1, 1))[:, 0], ""
    note = ""
    if rb.size < store.rs or cb.size < store.cs:  # finer than the overview keeps
        q1 = min(rb.stop, rows_n)
        held = store.recent_rows(layer)
        if held and held[0] <= rb.start and held[-1] >= q1 - 1:
            full = np.full((q1 - rb.start, q1), np.nan, dtype=np.float32)
            for i, q in enumerate(range(rb.start, q1)):
                full[i, : q + 1] = store.row(layer, q)[head]
            return rb, cb, _binned(full, rb.start, rb, cb), _sinks(store, layer, head, rb), ""
        if source is not None and source.can_recompute:
            mx, _ = source.recompute(layer, head, rb.start, q1, rb.size, cb.size, cb.start, cb.count)
            return rb, cb, mx, _sinks(store, layer, head, rb), (
                f"rows {rb.start}–{q1 - 1} recomputed (a prefill of positions 0..{q1 - 1}: exact for the prompt's "
                f"rows; a decode step of a ring, sink or quantized cache read otherwise)")
        rb, cb = _at_least(rb, store.rs), _at_least(cb, store.cs)
        note = "finer rows are not kept: drawn at the stored bins"
    mx, _, _ = store.overview(layer, head, rb.size, cb.size, rb.start // rb.size, rb.count, cb.start // cb.size,
                              cb.count)
    return rb, cb, mx, _sinks(store, layer, head, rb), note


def _at_least(b: bins.Bins, size: int) -> bins.Bins:
    """``b`` with bins of at least ``size`` (aligned: a multiple of it)."""
    return b if b.size >= size else bins.Bins(b.start - b.start % size, b.stop, size)


def _sinks(store: Any, layer: int, head: int, rb: bins.Bins) -> np.ndarray:
    size = max(rb.size, store.rs)
    share, _ = store.sink_share(layer, head, size, rb.start // size, rb.count)
    return share


def _bar(store, records, layer, head, token_texts, zoom, max_bins):
    """The newest row over the physical slots: ``(x, y, hover texts, width, binned?)`` or None."""
    t = records[-1].trace
    slots = _physical_slots(t, layer)
    if store is not None:
        row = store.row(layer, records[-1].position - 1)
        if row is None:
            return None
        row = row[head]
        if slots is not None:
            pos = np.asarray(slots.positions, dtype=np.int64)
            ok = (pos >= 0) & (pos < len(row))
            probs = np.where(ok, row[np.clip(pos, 0, len(row) - 1)], 0.0).astype(np.float32)
        else:
            probs = row.astype(np.float32)
    elif t.has_attention(layer):
        probs = (t.physical_attention(layer) if slots is not None else t.attention(layer))[-1, t.heads.index(head)]
        probs = probs.numpy()
    else:
        return None
    positions = list(slots.positions) if slots is not None else list(range(len(probs)))
    lo, hi = _span(zoom, "xaxis", len(probs))
    b = bins.plan(lo, hi, max_bins)
    if b.exact and (lo, hi) == (0, len(probs)):
        texts = [f"slot {s} · position {p} {_tok(p, token_texts)}" if p >= 0 else f"slot {s}: empty"
                 for s, p in enumerate(positions)]
        return list(range(len(probs))), probs, texts, None, probs
    y = bins.reduce(probs, b, "max")
    texts = [f"{b.label(i, 'slots')}" + ("" if b.exact else " · max") for i in range(b.count)]
    return onscreen.centres(b), np.nan_to_num(y), texts, (None if b.exact else b.size), probs


def spec(records: Sequence[StepRecord], layer: int, head: int, token_texts: Sequence[str] = (),
         gqa_groups: Sequence[Sequence[int]] = (), num_heads: int = 0, sinks: bool = False,
         zoom: dict | None = None, max_bins: int = MAX_BINS, source: Any = None) -> FigureSpec:
    """``sinks``: the model has learned attention sinks (gpt-oss); their share of each row (what the keys do not
    get) is drawn as its own column, left of slot 0 and of key position 0. ``zoom``: the axis ranges on screen
    (``xaxis``: slots of the bar; ``xaxis2``/``yaxis2``: key x query positions of the history); ``source``: the
    lane's :class:`~kvexplore.explorer.recompute.LaneAttention` (its store, and rows recomputed on a zoom)."""
    last = records[-1] if records else None
    store = _store(records, source)
    held = list(last.trace.heads) if last is not None and last.trace is not None and last.trace.heads else None
    elsewhere = held is not None and head not in held  # a rank's lane holds its own heads only (tp:N)
    if last is None or last.trace is None or elsewhere:
        bar = None
    else:
        bar = _bar(store, records, layer, head, token_texts, zoom, max_bins)
    have = not elsewhere and (bar is not None or (store is not None and store.has(layer) and last is not None))
    bar_x, bar_y, bar_text, width, whole = bar if bar is not None else ([], [], [], None, np.zeros(0))
    rows_n = last.position if last is not None else 0
    if have:
        rb, cb, matrix, sink_rows, note = _history(store, records, source, layer, head, rows_n, zoom, max_bins)
    else:
        rb = cb = bins.plan(0, 0, 1)
        matrix, sink_rows, note = np.zeros((0, 0), np.float32), np.zeros(0, np.float32), ""
    keep = ~np.isnan(matrix)
    ys, xs = np.nonzero(keep)
    hx = onscreen.centres(cb)[xs] if xs.size else np.zeros(0, np.int32)
    hy_all = onscreen.centres(rb)
    hy = hy_all[ys] if ys.size else np.zeros(0, np.int32)
    exact = rb.exact and cb.exact
    where = ("query position %{y} → key position %{x}<br>p = %{z:.4f}" if exact else
             f"query positions %{{y}} ± {(rb.size - 1) / 2:g} ({rb.size}) → key positions %{{x}} ± "
             f"{(cb.size - 1) / 2:g} ({cb.size})<br>max p = %{{z:.4f}}")
    kvh = len(gqa_groups)
    group_z = [[(2 if h == head else 1) if h in g else 0 for h in range(num_heads)] for g in gqa_groups]
    current = "" if last is None else f" · {_fed_and_produced(last, token_texts)}"
    zmax = colour_top(matrix[keep])
    traces = [
        dict(type="bar", name="current", x=bar_x, y=bar_y, customdata=bar_text, marker=dict(color="#3182bd"),
             hovertemplate="%{customdata}<br>" + ("p" if width is None else "max p") + " = %{y:.4f}<extra></extra>",
             xaxis="x", yaxis="y", **({} if width is None else {"width": width})),
        dict(type="heatmap", name="history", x=hx, y=hy, z=matrix[keep].astype(np.float32),
             colorscale=PROBABILITY_SCALE, zmin=0, zmax=zmax, xaxis="x2", yaxis="y2",
             colorbar=dict(title=dict(text=("p" if exact else "max p") + f"<br>{TOP_WORDS}", font=dict(size=11)),
                           len=0.5, y=0, yanchor="bottom", x=0.57, xanchor="left", thickness=10,
                           ticklabelposition="outside bottom"),  # clear of the title
             hovertemplate=where + "<extra></extra>"),
        # nothing captured (before the first step, after a Reset): its axes are hidden with the others, so the
        # grouping is not drawn either (a grid without its axis titles says nothing)
        dict(type="heatmap", name="gqa", z=group_z if have else [], x=list(range(num_heads)) if have else [],
             y=list(range(kvh)) if have else [], zmin=0, zmax=2,
             colorscale=[[0, "#f7f7f7"], [0.5, "#9ecae1"], [1, "#e6550d"]], showscale=False, xgap=2, ygap=2,
             xaxis="x3", yaxis="y3", hovertemplate="query head %{x} reads KV head %{y}<extra></extra>"),
    ]
    if sinks and have:  # the learned sink: one more column of the softmax, which reads no value
        traces.append(dict(type="bar", name="sink", x=[-1], y=[max(0.0, 1.0 - float(np.sum(whole)))],
                           marker=dict(color="#e6550d"), xaxis="x", yaxis="y",
                           hovertemplate="learned sink: p = %{y:.4f} (reads no value)<extra></extra>"))
        traces.append(dict(type="heatmap", name="sink history", x=np.full(rb.count, -1, dtype=np.int32), y=hy_all,
                           z=np.clip(np.nan_to_num(sink_rows[: rb.count]), 0, 1).astype(np.float32),
                           colorscale=SINK_SCALE, zmin=0, zmax=1, showscale=False, xaxis="x2", yaxis="y2",
                           hovertemplate="query position %{y} → learned sink<br>" + ("p" if rb.exact else "max p")
                           + " = %{z:.4f}<extra></extra>"))
    bar_range = (list((zoom or {})["xaxis"]) if (zoom or {}).get("xaxis") else
                 slot_range(len(whole), max((i for i, y in enumerate(whole) if y > 0), default=0)))
    notes = []
    if sinks and have:
        bar_range[0] = min(bar_range[0], -1.5)
        notes.append(dict(text="sink", x=-1, y=1, xref="x", yref="paper", yanchor="bottom", showarrow=False,
                          font=dict(size=11, color="#e6550d")))
    if have and bar is None:
        notes.append(dict(text="this step's row is no longer held (the newest rows are kept)", xref="paper",
                          yref="paper", x=0.5, y=0.85, showarrow=False))
    binned = "" if exact else f" · history binned {rb.size}×{cb.size} (max)"
    xaxis2 = dict(domain=[0, 0.55], anchor="y2", title=dict(text="key position", standoff=2))
    yaxis2 = dict(domain=[0, 0.5], anchor="x2", title=dict(text="query position"), autorange="reversed")
    z = zoom or {}
    if z.get("xaxis2"):
        xaxis2.update(range=list(z["xaxis2"]), autorange=False)
    if z.get("yaxis2"):
        yaxis2.update(range=list(z["yaxis2"]), autorange=False)
    layout = dict(
        height=620, margin=dict(l=60, r=10, t=50, b=40), showlegend=False,
        title=dict(text=f"attention · layer {layer} · query head {head} (reads KV head "
                        f"{next((g for g, hs in enumerate(gqa_groups) if head in hs), '?')}){current}{binned}"
                        + (f"<br><sup>{note}</sup>" if note else ""), font=dict(size=13)),
        xaxis=dict(domain=[0, 1], anchor="y", title=dict(text="physical slot" + (" (-1: the learned sink)" if sinks
                                                                                  else ""), standoff=2),
                   range=bar_range),
        yaxis=dict(domain=[0.68, 1], anchor="x", title=dict(text="p (now)"), rangemode="tozero"),
        xaxis2=xaxis2, yaxis2=yaxis2,
        xaxis3=dict(domain=[0.84, 1], anchor="y3", title=dict(text="query<br>heads"),
                    showticklabels=False),
        yaxis3=dict(domain=[0, 0.5], anchor="x3", title=dict(text="KV head"), dtick=1, autorange="reversed"),
        annotations=notes if have else [dict(
            text=(f"query head {head} is not in this lane's records: they hold query heads {held[0]}-{held[-1]} (a "
                  f"lane split over ranks holds rank 0's: the Ranks tab shows which rank holds which)" if elsewhere else
                  "no attention captured yet"), xref="paper", yref="paper", x=0.5, y=0.8, showarrow=False)],
    )
    return FigureSpec(traces, layout if have else hide_axes(layout))


def _physical_slots(t, layer: int):
    """The slot view attention of ``layer`` read from (a shared layer reads its source's), or None."""
    slots = t.slots_of(layer)
    if slots is not None and isinstance(slots.layout, SharedLayout):
        slots = t.slots_of(slots.layout.source)
    return slots if slots is not None and slots.positions else None


def _tok(pos: int, token_texts: Sequence[str]) -> str:
    return repr(token_texts[pos]) if 0 <= pos < len(token_texts) else ""


def _fed_and_produced(last: StepRecord, token_texts: Sequence[str]) -> str:
    """What the newest row is: the token fed at position p (the query) and the token it produced (the one the
    token strip rings), e.g. ``fed 2343 ' the' → produced ' GNU'``."""
    fed = last.position - 1
    made = _tok(last.position, token_texts) or repr(last.text)
    return " ".join(w for w in ("fed", str(fed), _tok(fed, token_texts), "→ produced", made) if w)


# the history's colours run from 0 to this quantile of the cells drawn (the cells above it take the darkest colour):
# a long history is mostly small probabilities under a few of nearly 1 (the first rows, a sink), which a scale to 1
# draws white
TOP_QUANTILE = 0.99
# narrow: the GQA grid's axis title is near; p99 is the 99th percentile drawn
TOP_WORDS = f"0 to p{100 * TOP_QUANTILE:.0f}"


def colour_top(z: np.ndarray) -> float:
    """The top of the history's colour scale: :data:`TOP_QUANTILE` of the probabilities ``z`` drawn (1 when there
    are none, or all are 0)."""
    top = float(np.quantile(z, TOP_QUANTILE)) if z.size else 0.0
    return top if top > 0 else 1.0


def from_snapshot(s) -> FigureSpec:
    ln = s.lane
    c = s.config
    detail = ln.detail
    return spec(ln.history, s.layer, s.head, detail.texts if detail else (), c.gqa_groups, c.num_heads,
                c.attention_sinks, zoom=s.zoom.get("attention"), max_bins=s.max_bins,
                source=getattr(detail, "attention", None) if detail else None)
