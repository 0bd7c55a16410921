"""What a press did, per KV head, in position space: its scores with what it kept (:func:`scores_spec`), and which
positions every pressed layer's heads hold now (:func:`kept_spec`), both from the press state a pressing cache's
records carry (:mod:`kvexplore.trace.press`). Binned beyond ``max_bins`` positions on screen: a bin shows its highest
score and the share of its positions kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..trace.press import PressStep
from ..trace.records import StepRecord
from . import bins, onscreen
from .snapshot import MAX_BINS
from .spec import FigureSpec, columns, hide_axes

# scores of the evicted in reds (light: low score), of the kept in blues (dark: high score): z = kept + score in 0..1
SCORE_SCALE = [[0.0, "#fb6a4a"], [0.4999, "#67000d"], [0.5, "#c6dbef"], [1.0, "#08306b"]]
HELD_SCALE = [[0.0, "#d62728"], [0.5, "#f2d0a4"], [1.0, "#2171b5"]]  # share of a cell's positions held
ROW_LABELS = 12  # row labels a figure of the explorer's height has room for (every n-th row's beyond that)


def press_of(record: StepRecord | None) -> PressStep | None:
    """The press state recorded with ``record`` (None: no record, no trace, or a cache that does not press)."""
    return record.trace.press if record is not None and record.trace is not None else None


def presses(records: Sequence[StepRecord]) -> bool:
    """Whether a lane's records carry a press state (its cache presses): the views of this module apply to it."""
    return any(press_of(r) is not None for r in records)


def empty(note: str, title: str) -> FigureSpec:
    layout = dict(title=dict(text=title, font=dict(size=13), x=0.01, xanchor="left"), xaxis={}, yaxis={},
                  annotations=[dict(text=note, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                                    font=dict(size=13))], height=340)
    return FigureSpec([], hide_axes(layout))


def _why_not(record: StepRecord | None, lane: str, layer: int) -> str | None:
    press = press_of(record)
    if record is None:
        return "no step yet: enter a prompt and press Prefill"
    if press is None:
        return (f"{lane} does not press: run an evict lane beside it<br>(strategies=[..., 'evict'], "
                f"strategy_options={{'evict': {{'press': 'snapkv'}}}})")
    if layer not in press.held:
        return f"layer {layer} is not pressed (it keeps its own cache); pressed layers: {press.layers}"
    return None


def _token(texts: Sequence[str], p: int) -> str:
    return repr(texts[p]) if p < len(texts) else ""


def scores_spec(record: StepRecord | None, lane: str, layer: int, texts: Sequence[str] = (),
                zoom: dict | None = None, max_bins: int = MAX_BINS) -> FigureSpec:
    """The last press's score of every position each KV head of ``layer`` held then, coloured by what it kept
    (blues: kept, reds: evicted; darker: higher score, scaled per head). One cell per position (or bin) and head;
    ``customdata``: the score (a bin's highest; NaN where nothing was held, and for an infinite score, which the
    hover names); ``z``: 1 + the score scaled to 0..1 per head where kept (a bin: half its held positions kept or
    more), else the scaled score (NaN: nothing held)."""
    why = _why_not(record, lane, layer)
    press = press_of(record)
    if why is None and press.last is None:
        why = "no press yet: the first press runs after the prompt"
    if why is None and layer not in press.last.scores:
        why = f"layer {layer} held everything at the last press (no scores)"
    if why is not None:
        return empty(why, f"press scores · {lane}")
    last = press.last
    scores = last.scores[layer].numpy().astype(np.float32)
    kept = last.kept[layer].numpy()
    heads, n = scores.shape
    b, view_range = onscreen.axis_bins(zoom, "xaxis", n, (-0.5, n - 0.5), max_bins)
    best = bins.reduce(scores, b, "max")
    held = ~np.isnan(scores)
    kept_n, held_n = _count(held & kept, b), _count(held, b)
    finite = np.where(np.isfinite(scores), scores, np.nan)  # a press may give +inf (always kept: SnapKV's window)
    lo, hi = _rows(np.nanmin, finite), _rows(np.nanmax, finite)
    with np.errstate(invalid="ignore"):
        scaled = np.clip((best - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0, 1.0) * 0.998
    scaled = np.where(np.isposinf(best), 0.998, np.where(np.isneginf(best), 0.0, scaled))
    z = np.where(2 * kept_n >= np.maximum(held_n, 1), 1.0 + scaled, scaled).astype(np.float32)
    on = np.ones_like(held_n, dtype=bool)  # every bin has its cell (NaN: nothing held), or plotly widens neighbours
    z = np.where(held_n > 0, z, np.nan).astype(np.float32)
    cells = columns(z, on)
    x = onscreen.centres(b)
    cells["x"] = x[cells["x"]]
    score_flat = best[on]
    customdata = np.where(np.isfinite(score_flat), score_flat, np.nan).astype(np.float32)  # JSON has no infinity
    text = []
    for h, i, s, k, m in zip(cells["y"].tolist(), np.nonzero(on)[1].tolist(), score_flat.tolist(),
                             kept_n[on].tolist(), held_n[on].tolist()):
        first = b.start + i * b.size
        if not m:
            text.append("")
        elif b.exact:
            text.append(f"KV head {h} · position {first} {_token(texts, first)}<br>score {s:.4g} · "
                        f"{'kept' if k else 'evicted'}")
        else:
            text.append(f"KV head {h} · {b.label(i)}<br>highest score {s:.4g} · {int(k)} of {int(m)} held kept")
    gap = 1 if b.count <= 128 else 0
    heat = dict(type="heatmap", name="scores", x=cells["x"], y=cells["y"], z=cells["z"], customdata=customdata,
                text=text, hovertemplate="%{text}<extra></extra>", zmin=0.0, zmax=2.0, colorscale=SCORE_SCALE,
                showscale=False, xgap=gap, ygap=2, hoverongaps=False)
    legend = [dict(type="scatter", name=name, x=[None], y=[None], mode="markers", hoverinfo="skip",
                   marker=dict(symbol="square", size=12, color=colour), showlegend=True)
              for name, colour in (("kept (darker: higher score)", "#2171b5"),
                                   ("evicted (darker: higher score)", "#cb181d"))]
    per_head = ", ".join(str(int(c)) for c in kept.sum(1))
    shown = onscreen.describe(b, n, "positions")
    title = (f"{last.press or 'press'} scores · {lane} · layer {layer} · {last.reason} press at {last.length}<br>"
             f"kept per KV head: {per_head} of {int(held[0].sum())} held then")
    layout = dict(title=dict(text=title, font=dict(size=13), x=0.01, xanchor="left"),
                  xaxis=dict(title=dict(text="position" + (f"<br>{shown}" if shown else ""), standoff=4),
                             range=view_range, autorange=False, automargin=True, zeroline=False),
                  yaxis=dict(title=dict(text="KV head"), autorange="reversed", zeroline=False,
                             tickvals=list(range(heads)), ticktext=[f"h{h}" for h in range(heads)]),
                  legend=dict(orientation="h", y=-0.42, font=dict(size=12)),
                  height=max(320, 220 + 28 * heads), margin=dict(l=60, r=20, t=70, b=110))
    return FigureSpec([heat, *legend], layout)


def _rows(how, values: np.ndarray) -> np.ndarray:
    """``how`` (nanmin, nanmax) of each row, NaN for a row with no number (without numpy's warning)."""
    out = np.full((values.shape[0], 1), np.nan, dtype=np.float32)
    some = ~np.isnan(values).all(1)
    if some.any():
        out[some, 0] = how(values[some], axis=1)
    return out


def _count(mask: np.ndarray, b: bins.Bins) -> np.ndarray:
    """How many true entries of ``mask`` (last axis: positions) each bin holds."""
    m = np.zeros((*mask.shape[:-1], b.count * b.size), dtype=np.float32)
    lo, hi = b.start, min(b.stop, mask.shape[-1])
    m[..., : hi - lo] = mask[..., lo:hi]
    return m.reshape(*mask.shape[:-1], b.count, b.size).sum(-1)


def kept_spec(record: StepRecord | None, lane: str, texts: Sequence[str] = (), zoom: dict | None = None,
              max_bins: int = MAX_BINS) -> FigureSpec:
    """Per pressed layer and KV head (rows), the positions held now (blue) and evicted (red), in position order;
    ``z``: the share of a cell's positions held (1 or 0 at full resolution). The last press's length is marked."""
    press = press_of(record)
    why = _why_not(record, lane, next(iter(press.held), 0) if press is not None else 0)
    if why is not None:
        return empty(why, f"positions held per head · {lane}")
    rows = [(layer, h) for layer in press.layers for h in range(len(press.held[layer]))]
    mask = np.concatenate([press.kept_mask(layer) for layer in press.layers]).astype(np.float32)
    n = press.length
    b, view_range = onscreen.axis_bins(zoom, "xaxis", n, (-0.5, n - 0.5), max_bins)
    share = bins.reduce(mask, b, "mean")
    on = ~np.isnan(share)
    cells = columns(share, on)
    x = onscreen.centres(b)
    cells["x"] = x[cells["x"]]
    gap = 1 if b.count <= 128 else 0
    where = "position %{x}" if b.exact else f"the {b.size} positions around %{{x}}"
    heat = dict(type="heatmap", name="kept mask", **cells, zmin=0.0, zmax=1.0, colorscale=HELD_SCALE,
                showscale=False, xgap=gap, ygap=1 if len(rows) <= 48 else 0, xaxis="x", yaxis="y", hoverongaps=False,
                hovertemplate=f"%{{y}} · {where}<br>%{{z:.0%}} held"
                              "<br>(hover the token row for the token)<extra></extra>")
    edges = b.edges().tolist()
    token_text = [f"{b.label(i)} {_token(texts, first) if b.exact else ''}".strip() for i, first in enumerate(edges)]
    tokens = dict(type="heatmap", name="tokens", x=x, y=np.zeros(b.count, dtype=np.int32),
                  z=np.ones(b.count, dtype=np.float32), text=token_text, hovertemplate="%{text}<extra></extra>",
                  zmin=0.0, zmax=1.0, colorscale=[[0, "#eeeeee"], [1, "#eeeeee"]], showscale=False, xgap=gap,
                  xaxis="x", yaxis="y2")
    shapes = []
    if press.last is not None and b.start <= press.last.length <= b.stop:
        shapes.append(dict(type="line", xref="x", yref="paper", x0=press.last.length - 0.5,
                           x1=press.last.length - 0.5, y0=0, y1=1, line=dict(color="#444", width=1.5, dash="dot")))
    counts = [c for layer in press.layers for c in press.held[layer]]
    held = f"each head holds {counts[0]}" if len(set(counts)) == 1 else f"heads hold {min(counts)}–{max(counts)}"
    last = f"{press.last.press} {press.last.reason} press at {press.last.length} (dotted)".lstrip() \
        if press.last else "no press yet"
    shown = onscreen.describe(b, n, "positions")
    layout = dict(title=dict(text=f"held per head · {lane} · step {record.step} · {last}<br>"
                                  f"{held} of {n} positions · <span style='color:#2171b5'>■ held</span> "
                                  f"<span style='color:#d62728'>■ evicted</span>", font=dict(size=13), x=0.01,
                                  xanchor="left"),
                  xaxis=dict(title=dict(text="position" + (f"<br>{shown}" if shown else ""), standoff=4),
                             range=view_range, autorange=False, automargin=True, zeroline=False),
                  yaxis=dict(title=dict(text="layer · KV head"), autorange="reversed", domain=[0, 0.88], zeroline=False,
                             tickvals=list(range(len(rows))), ticktext=[f"L{l} h{h}" for l, h in rows],
                             dtick=1 if len(rows) <= ROW_LABELS else None),
                  yaxis2=dict(domain=[0.91, 1], anchor="x", tickvals=[0], ticktext=["token"], fixedrange=True),
                  shapes=shapes, showlegend=False,
                  height=max(340, 200 + 16 * min(len(rows), 60)), margin=dict(l=70, r=20, t=70, b=60))
    if len(rows) > ROW_LABELS:
        layout["yaxis"].pop("dtick")
        step = -(-len(rows) // ROW_LABELS)
        layout["yaxis"]["tickvals"] = layout["yaxis"]["tickvals"][::step]
        layout["yaxis"]["ticktext"] = layout["yaxis"]["ticktext"][::step]
    return FigureSpec([heat, tokens], layout)


def scores_from_snapshot(s) -> FigureSpec:
    """The press scores of the lane shown (named by its lane name: ``evict@mask``, a fork's)."""
    ln = s.lane
    return scores_spec(ln.last, ln.name, s.layer, ln.detail.texts if ln.detail else (), s.zoom.get("press"),
                       s.max_bins)


def kept_from_snapshot(s) -> FigureSpec:
    ln = s.lane
    return kept_spec(ln.last, ln.name, ln.detail.texts if ln.detail else (), s.zoom.get("kept"), s.max_bins)
