"""Tensors: the size of every stored key and value (L2 norm over head_dim, the same before and after RoPE) per
physical slot and KV head, and for the quantized cache the error its integers introduce (max |x - dequant(quant(x))|
per position and head, and per channel of the keys and of the values). Empty, stale and evicted slots are blank.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence

import numpy as np
import torch

from ..caches.base import SlotView
from ..caches.channel_detail import OUTLIER, PartDetail
from ..trace.records import StepRecord
from . import bins, lettering, onscreen
from .snapshot import MAX_BINS
from .spec import FigureSpec, columns, hide_axes, slot_range


# Where the panels go, as shares of the plot area (plotly's paper): they hold 18 px type in the narrowest case, about
# 330 x 270 px of plot area (the view 440 px tall presenting, 424 px wide in JupyterLab with its file browser open)
POSITIONS = 0.24  # the position axis beside the two panels per channel (alone, it takes the whole width)
CHANNELS, GUTTER = 0.29, 0.08  # each panel per channel, and between the two the room their titles need ("V ≤ 0.0013")
ERROR_ROW = 0.24  # the bottom row: the error per position (and per channel); its axes' labels in the margin below
NOTE_ROW, NOTE_MARGIN = 0.34, 0.1  # at most, the error row as a note; the margin under it that the note runs on into
BETWEEN = 0.03  # between the keys and the values (the slot axis is labelled under the values only)
LINE = 0.085  # one line of tick labels or of an axis title (27 px at 18 px: the lines' spacing)
PAD = 0.03  # between the slot axis' title and the error row
HEAD_LABELS = 14  # KV head labels a row as tall as the plot area holds without touching
PLOT_PX = 270  # the plot area's width in the narrowest case: a 424 px figure less its margins and colour bars
DIGIT_PX = 10  # a digit of a tick label at 18 px, the larger type (at 12 px the same count has room)
TITLE_PX = 400  # what the slot axis' title wraps to at 18 px: the narrowest figure less 12 px each side (centred
# under the plot, a line may run on under the colour bars)
NOTE_CHARS = 40  # what the note wraps to: a line of it at 18 px in the narrowest figure


def panel_rows(title_lines: int = 1, note_lines: int = 0) -> dict[str, list[float]]:
    """The vertical domains of the three rows: ``keys`` on top, ``values`` under them with room below for the slot
    axis' tick labels and its title of ``title_lines`` lines, and ``error`` at the bottom; where the error row is a
    note of ``note_lines`` lines instead (it runs on into the margin below), as tall as the lines need (at most
    :data:`NOTE_ROW`)."""
    error = min(NOTE_ROW, max(LINE, LINE * note_lines - NOTE_MARGIN)) if note_lines else ERROR_ROW
    under = LINE * (1 + title_lines) + PAD
    h = (1 - error - under - BETWEEN) / 2
    low = error + under
    return {"keys": [low + h + BETWEEN, 1.0], "values": [low, low + h], "error": [0.0, error]}


def head_step(n: int, domain: Sequence[float]) -> int:
    """The step between labelled KV heads (``n`` of them) in a row spanning ``domain``: every head while they fit."""
    return max(1, math.ceil(n / max(1, int(HEAD_LABELS * (domain[1] - domain[0])))))


def nticks(share: float, digits: int) -> int:
    """The most tick labels of ``digits`` digits, each with two digits' room beside it, that an axis ``share`` of the
    plot area wide holds in the narrowest case (plotly picks round steps for up to that many)."""
    return max(2, int(share * PLOT_PX / ((digits + 2) * DIGIT_PX)))


def bar(title: str, domain: Sequence[float], **ticks) -> dict:
    """A colour bar beside the row spanning ``domain``: centred on it and a fifth shorter, so that its end labels
    stay beside the row, with its title along its right side (above it, the title met the top label)."""
    lo, hi = domain
    return dict(title=dict(text=title, side="right"), len=0.8 * (hi - lo), y=(lo + hi) / 2, yanchor="middle",
                thickness=12, xpad=4, **ticks)


def physical(norms: torch.Tensor, positions: Sequence[int]) -> np.ndarray:
    """``norms`` (kv_heads, logical positions) laid out over physical slots: float32, NaN where no position."""
    pos = np.asarray(positions, dtype=np.int64)
    ok = (pos >= 0) & (pos < norms.shape[-1])
    out = np.full((norms.shape[0], len(pos)), np.nan, dtype=np.float32)
    out[:, ok] = norms.numpy()[:, pos[ok]]
    return out


def binned(rows: np.ndarray, b: bins.Bins, how: str) -> dict[str, np.ndarray]:
    """``rows`` (heads, indices) over the bins ``b`` (each bin's ``how`` of what it holds) as heatmap columns, slot
    by slot (a Step that fills the next slot appends to the arrays) with each bin at its centre."""
    z = bins.reduce(rows, b, how) if len(rows) else np.zeros((0, b.count), np.float32)
    cells = columns(z.T)
    return dict(x=onscreen.centres(b)[cells["y"]], y=cells["x"], z=cells["z"])


def spec(record: StepRecord | None, norms: torch.Tensor | None, layer: int,
         quant_error: torch.Tensor | None = None, slots: SlotView | None = None,
         zoom: dict[str, tuple[float, float]] | None = None, max_bins: int = MAX_BINS, did: str = "",
         lossy: bool = False, channel_error: tuple[torch.Tensor, torch.Tensor] | None = None,
         channel_detail: tuple[PartDetail, PartDetail] | None = None) -> FigureSpec:
    """``norms``: (2, kv_heads, positions) for ``layer`` (keys, values); ``quant_error``: (kv_heads, length);
    ``channel_error``: the keys' and values' max error per KV head and channel (two panels beside it);
    ``channel_detail``: what those panels show on hover (the codes, scales and zeros of each channel's worst block)
    and mark (outlier channels, as written and where the codes are taken);
    ``slots``: the cache's slot view now (default: the one recorded with ``record``). ``zoom``: the slots on screen
    (``{"xaxis": (first, last)}``); beyond ``max_bins`` slots each cell is a bin's mean norm (the error: its max).
    ``did``: what the cache did so far (said in place of an error row that is all zero: nothing quantized yet);
    ``lossy``: the cache stores lossily by design, so no error row (``quant_error`` None) means none is kept, not
    none made (llama.cpp's cache types keep no originals)."""
    if slots is None and record is not None and record.trace is not None:
        slots = record.trace.slots_of(layer)
    positions = list(slots.positions) if slots is not None and slots.positions else (
        list(range(record.position)) if record is not None else [])  # no cache: every position was recomputed
    empty = np.zeros((0, 0), np.float32)
    k_rows = physical(norms[0], positions) if norms is not None else empty
    v_rows = physical(norms[1], positions) if norms is not None else empty
    kvh = len(k_rows)
    qe = quant_error.numpy() if quant_error is not None else empty
    common = dict(colorscale="Viridis", xgap=0, ygap=1)
    ce = [t.numpy().astype(np.float32) for t in channel_error] if channel_error is not None else []
    top = max([float(np.nanmax(qe)) if qe.size else 0.0] + [float(c.max()) for c in ce if c.size])
    ce = ce if top > 0 else []  # the panels per channel once something is stored lossily (before: the note says why)
    held = [i for i, p in enumerate(positions) if p >= 0]
    b, span = onscreen.axis_bins(zoom, "xaxis", len(positions), slot_range(len(positions), held[-1] if held else 0),
                                 max_bins)
    eb = bins.plan(0, qe.shape[-1] if qe.size else 0, max_bins)
    where = "slot %{x}" if b.exact else f"the {b.size} slots around %{{x}}"
    mean = "" if b.exact else "mean "
    # a row that would be all zero or empty (an exact cache, nothing quantized yet) is a note instead, saying why
    said = "" if quant_error is not None and top > 0 else \
        f"{did or 'stored lossily'}; the originals are not kept, so no error per position (kvexplore doctor " \
        "measures it)" if quant_error is None and lossy else \
        "exact cache: stored as computed, no error" if quant_error is None else did or "no error yet"
    shown = onscreen.describe(b, len(positions))
    slot_title = lettering.wrap("physical slot" + (f" · {shown}" if shown else ""), 18, TITLE_PX)
    note = _wrap(said)
    row = panel_rows(slot_title.count("<br>") + 1, note.count("<br>") + 1 if said else 0)
    # flat float32 columns travel as binary buffers, where NaN (an empty slot, drawn as a gap) is allowed; a 2-D
    # array would travel as JSON, which has no NaN
    k_cells, v_cells = binned(k_rows, b, "mean"), binned(v_rows, b, "mean")  # the bars' ends: what is drawn
    traces = [
        dict(type="heatmap", name="key norms", **k_cells, xaxis="x", hoverongaps=False,
             yaxis="y", colorbar=bar("‖k‖", row["keys"], **_ends(k_cells["z"])),
             hovertemplate=f"KV head %{{y}} · {where}<br>{mean}‖k‖ = %{{z:.3f}}<extra></extra>", **common),
        dict(type="heatmap", name="value norms", **v_cells, xaxis="x2", hoverongaps=False,
             yaxis="y2", colorbar=bar("‖v‖", row["values"], **_ends(v_cells["z"])),
             hovertemplate=f"KV head %{{y}} · {where}<br>{mean}‖v‖ = %{{z:.3f}}<extra></extra>", **common),
        dict(type="heatmap", name="quantization error", **binned(qe.astype(np.float32), eb, "max"), colorscale="Reds",
             zmin=0, zmax=top or 1.0, xaxis="x3", yaxis="y3", ygap=1, visible=not said,
             colorbar=bar("err", row["error"], tickvals=[0, top or 1.0], ticktext=["0", f"{top or 1.0:.2g}"]),
             hovertemplate="KV head %{y} · position %{x}" + ("" if eb.exact else f" (bins of {eb.size})") +
                           "<br>max |error| = %{z:.4g}<extra></extra>"),
    ]
    details = list(channel_detail) if channel_detail is not None and ce else [None, None]
    for i, (part, rows, detail) in enumerate(zip(("keys", "values"), ce, details)):  # each to its own largest error
        text = {} if detail is None else dict(text=block_text(detail))
        traces.append(dict(type="heatmap", name=f"{part} error per channel", **columns(rows), colorscale="Reds",
                           zmin=0, zmax=float(rows.max()) or 1.0, showscale=False, xaxis=f"x{4 + i}",
                           yaxis=f"y{4 + i}", ygap=1, **text,
                           hovertemplate=f"{part} · KV head %{{y}} · channel %{{x}}<br>max |error| = %{{z:.4g}}"
                                         + ("<br>%{text}" if text else "") + "<extra></extra>"))
        if detail is not None:
            traces += outlier_marks(detail, f"x{4 + i}", f"y{4 + i}")
    layout = layout_for(layer, row, kvh, span, slot_title, len(positions), qe.shape[-1] if qe.size else 0, ce, note)
    return FigureSpec(traces, layout if positions else hide_axes(layout))


def layout_for(layer: int, row: dict[str, list[float]], kvh: int, span: list[float], slot_title: str, slots: int,
          length: int, ce: list[np.ndarray], note: str) -> dict:
    """The figure's layout: the keys' and the values' rows over ``slots`` physical slots (``span`` on screen,
    labelled under the values), and the error row: ``length`` positions beside the panels per channel (``ce``), or
    the ``note`` alone where it would be empty or all zero."""
    heads = dict(range=[-0.5, max(kvh, 1) - 0.5], zeroline=False)  # (a zero line would run through head 0)
    layout = dict(
        height=560, margin=dict(l=50, r=20, t=44, b=40), showlegend=False,
        title=dict(text=f"stored keys and values per KV head · layer {layer}", font=dict(size=13)),
        # the keys and the values share the slot axis: its tick labels and title under the values only
        xaxis=dict(anchor="y", range=span, matches="x2", showticklabels=False),
        yaxis=dict(domain=row["keys"], anchor="x", title=dict(text="keys"), dtick=head_step(kvh, row["keys"]),
                   **heads),
        xaxis2=dict(anchor="y2", title=dict(text=slot_title, standoff=0), range=span,
                    nticks=nticks(1, len(str(slots)))),
        yaxis2=dict(domain=row["values"], anchor="x2", title=dict(text="values"),
                    dtick=head_step(kvh, row["values"]), **heads),
        xaxis3=dict(domain=[0, POSITIONS if ce else 1], anchor="y3", title=dict(text="position", standoff=0),
                    nticks=nticks(POSITIONS if ce else 1, len(str(length))), visible=not note),
        yaxis3=dict(domain=row["error"], anchor="x3", title=dict(text="error"),
                    dtick=head_step(kvh, row["error"]), visible=not note, **heads),
        # the note from the error row's top down (into the margin its axis labels would take)
        annotations=[dict(text=note, xref="paper", yref="paper", x=0.5, y=row["error"][1], yanchor="top",
                          showarrow=False, font=dict(size=11, color="#666"))] if note else [],
    )
    for i, (part, rows) in enumerate(zip(("keys", "values"), ce)):
        left = 1 - CHANNELS - (CHANNELS + GUTTER) * (1 - i)
        layout[f"xaxis{4 + i}"] = dict(domain=[left, left + CHANNELS], anchor=f"y{4 + i}",
                                       nticks=nticks(CHANNELS, len(str(rows.shape[1]))),
                                       title=dict(text=f"{part[0].upper()} ≤ {float(rows.max()):.2g}", standoff=0),
                                       range=[-0.5, rows.shape[1] - 0.5])
        layout[f"yaxis{4 + i}"] = dict(domain=row["error"], anchor=f"x{4 + i}", showticklabels=i == 0,
                                       dtick=head_step(rows.shape[0], row["error"]), range=[-0.5, rows.shape[0] - 0.5])
    return layout


def block_text(d: PartDetail) -> list[str]:
    """Per KV head and channel (row by row, as :func:`~.spec.columns` lays the cells), the hover's lines: the block
    where the channel lost the most, its codes there, its scale and zero point there (one, or a range over the
    block's positions on the token axis), and the channel's largest magnitude as written and where quantized."""
    H, D, G = d.codes.shape
    out = []
    for h in range(H):
        for c in range(D):
            b = int(d.block[h, c])
            codes = [str(x) for x in d.codes[h, c].tolist()]
            s, z = d.scale[h, c], d.zero[h, c]
            scale = (f"scale {float(s[0]):.3g}, zero {float(z[0]):.3g}" if s.numel() == 1 else
                     f"scales {float(s.min()):.3g}..{float(s.max()):.3g}, "
                     f"zeros {float(z.min()):.3g}..{float(z.max()):.3g} (one a position)")
            size = f"max |x| {float(d.written[h, c]):.3g} as written" + (
                "" if d.quantized is None else f", {float(d.quantized[h, c]):.3g} where quantized")
            out.append(f"block {b} (positions {b * G}..{b * G + G - 1}), {d.bits}-bit codes:<br>"
                       f"{' '.join(codes[:16])}<br>{' '.join(codes[16:])}<br>{scale}<br>{size}")
    return out


def outlier_marks(d: PartDetail, xaxis: str, yaxis: str) -> list[dict]:
    """Marks over the channels that are outliers (at least :data:`OUTLIER` times their head's median channel): a
    ring as the model wrote them, a cross where the codes are taken when that is elsewhere (a rotation spreads
    them)."""
    out = []
    for which, symbol, colour, where in (("written", "circle-open", "#222", "as written"),
                                         ("quantized", "x-thin-open", "#1f77b4", "where quantized")):
        if which == "quantized" and d.quantized is None:
            continue
        mags = d.written if which == "written" else d.quantized
        heads, chans = torch.nonzero(d.outliers(which), as_tuple=True)
        out.append(dict(type="scatter", mode="markers", name=f"{d.part}: outlier channels {where}",
                        x=chans.numpy().astype(np.int32), y=heads.numpy().astype(np.int32),
                        customdata=mags[heads, chans].numpy().astype(np.float32), xaxis=xaxis, yaxis=yaxis,
                        marker=dict(symbol=symbol, size=9, color=colour, line=dict(width=1.5, color=colour)),
                        hovertemplate=f"{d.part} · KV head %{{y}} · channel %{{x}}<br>max |x| %{{customdata:.3g}} "
                                      f"{where}: {OUTLIER:g}x its head's median channel or more<extra></extra>"))
    return out


def _ends(rows: np.ndarray) -> dict:
    """A colour bar's labels, at its two ends only (more overprint on a bar this short) and to two digits (the
    hover has more): the least and the largest of ``rows``, the cells drawn (a label past the bar's end, such as a
    raw norm that no bin's mean reaches, is not drawn)."""
    held = rows[np.isfinite(rows)] if rows.size else rows
    if not held.size:
        return {}
    lo, hi = float(held.min()), float(held.max())
    return dict(tickvals=[lo, hi], ticktext=[f"{lo:.2g}", f"{hi:.2g}"])


def _wrap(text: str, width: int = NOTE_CHARS) -> str:
    """``text`` broken into lines of about ``width`` characters (an annotation does not wrap by itself)."""
    return "<br>".join(textwrap.wrap(text, width))


def state_spec(history: tuple[list[int], torch.Tensor], layer: int) -> FigureSpec:
    """A linear-attention layer: no stored keys or values, but one state matrix per value head, rewritten every step.
    ``history``: the sequence lengths at which it was recorded and each head's ``‖S‖`` then, ``(steps, heads)``."""
    ends, norms = history
    z = norms.numpy().astype(np.float32).T  # (heads, steps)
    heads = z.shape[0]
    trace = dict(type="heatmap", name="state norms", **columns(z), colorscale="Viridis", xgap=0, ygap=1,
                 colorbar=dict(title=dict(text="‖S‖"), thickness=12),
                 hovertemplate="value head %{y} · record %{x}<br>‖S‖ = %{z:.3f}<extra></extra>")
    every = max(1, len(ends) // 12)
    layout = dict(height=560, margin=dict(l=70, r=20, t=50, b=40), showlegend=False,
                  title=dict(text=f"recurrent state · layer {layer}<br>(linear attention: a fixed block, no slots)",
                             font=dict(size=13)),
                  xaxis=dict(title=dict(text="after the step that reached length"),
                             tickvals=list(range(0, len(ends), every)), ticktext=[str(n) for n in ends[::every]]),
                  yaxis=dict(title=dict(text="value head"), dtick=1, range=[-0.5, heads - 0.5]))
    return FigureSpec([trace], layout)


def from_snapshot(s) -> FigureSpec:
    ln = s.lane
    d = ln.detail
    if d is not None and d.state is not None:
        return state_spec(d.state, s.layer)
    return spec(ln.last, d.norms if d else None, s.layer, d.stored_error if d else None,
                d.slots[s.layer] if d and d.slots else None, zoom=s.zoom.get("tensors"), max_bins=s.max_bins,
                did=ln.did, lossy=d.lossy if d else False, channel_error=d.channel_error if d else None,
                channel_detail=d.channel_detail() if d and d.channel_detail else None)
