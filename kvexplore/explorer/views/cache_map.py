"""Cache map: layers x physical slots, coloured by what each slot holds and what this step did with it.

For the pre-allocated cache the write window is ``k.narrow(2, pos, q_len)`` and the read window
``k.narrow(2, 0, pos + q_len)``; other strategies draw their own storage order: the paged cache its pages (the
block table in the title), the quantized cache its quantized slots then its full-precision residual, the sink
cache its sinks then its ring. Every layer stores the same positions, so the rows agree; hover names the token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...caches.base import EVICTED, FILLED, FREE, SHARED, STALE, SlotView
from ...records import StepRecord
from .palette import SLOT_CLASSES, SLOT_COLOURS, SLOT_MEANING, discrete_colorscale
from .spec import FigureSpec, columns, hide_axes, slot_range

CODE = {name: i for i, name in enumerate(SLOT_CLASSES)}


def slot_classes(record: StepRecord, slots: SlotView | None = None, fresh: bool = True) -> list[str]:
    """The class of every physical slot (see :data:`SLOT_CLASSES`): after ``record``'s step, or in ``slots`` (the
    cache now) with the step's windows marked only when the cache is still as the step left it (``fresh``)."""
    slots = slots if slots is not None else record.trace.slots
    written = _written(record) if fresh else set()
    read = set(record.trace.read_positions) if fresh else {p for p in slots.positions if p >= 0}
    out = []
    for state, pos, sharers in zip(slots.states, slots.positions, slots.sharers):
        if state in (FILLED, SHARED) and pos >= 0:
            if pos in written:
                out.append("written")
            elif pos in read:
                out.append("shared" if state == SHARED or sharers > 1 else "read")
            else:
                out.append("not read")
        elif state in (FILLED, SHARED):
            out.append("not read")
        else:
            out.append({FREE: "free", STALE: "stale", EVICTED: "evicted"}[state])
    return out


def _written(record: StepRecord) -> set[int]:
    if record.trace.events:
        start, count = record.trace.events[0].write
        return set(range(start, start + count))
    return set()


def spec(record: StepRecord | None, kind: str, num_layers: int, token_texts: Sequence[str] = (),
         title: str = "", slots: SlotView | None = None, fresh: bool = True, after: str = "") -> FigureSpec:
    """The cache map after ``record``'s step (``None``: before any step). ``token_texts[p]`` names position p.

    ``slots``: the cache's slot view now (default: the one recorded with the step); ``fresh=False`` when the cache
    is no longer as the step left it (``after`` a rewind or a fork): the step's windows are then not drawn."""
    classes, positions, layout_info = [], [], {}
    if record is not None and record.trace is not None and (slots or record.trace.slots) is not None:
        view = slots if slots is not None else record.trace.slots
        classes = slot_classes(record, view, fresh)
        positions = view.positions
        layout_info = view.layout
    n = len(classes)
    row = np.array([CODE[c] for c in classes], dtype=np.int8)
    scale = dict(zmin=-0.5, zmax=len(SLOT_CLASSES) - 0.5, colorscale=discrete_colorscale(SLOT_COLOURS))
    # every layer holds the same positions: the layer rows carry numbers only (sent as binary arrays), and one row
    # on top names the token in each slot when hovered
    heat = dict(type="heatmap", name="slots", **columns(np.tile(row, (num_layers, 1))),
                xgap=1 if n <= 128 else 0, ygap=1, xaxis="x", yaxis="y",
                hovertemplate="layer %{y} · slot %{x}<br>(hover the token row for what it holds)<extra></extra>",
                showscale=False, **scale)
    hover_row = [_hover(i, positions[i], classes[i], token_texts) for i in range(n)]
    names = dict(type="heatmap", name="tokens", z=row[None, :], customdata=[hover_row], x=np.arange(n), y=[0],
                 xgap=1 if n <= 128 else 0, xaxis="x", yaxis="y2", showscale=False,
                 hovertemplate="%{customdata}<extra></extra>", **scale)
    # the legend: one square per slot class (a heatmap has none of its own)
    legend = [dict(type="scatter", name=cls, x=[None], y=[None], mode="markers", xaxis="x", yaxis="y",
                   marker=dict(symbol="square", size=12, color=colour, line=dict(color="#999", width=1)),
                   hoverinfo="skip", showlegend=True) for cls, colour in zip(SLOT_CLASSES, SLOT_COLOURS)]
    used = [i for i, c in enumerate(classes) if c != "free"]
    view_range = slot_range(n, used[-1] if used else 0)
    shapes, annotations, ticks = _strategy_layout(kind, layout_info, n, num_layers)
    if record is None:
        annotations.append(_note("no step yet: enter a prompt and press Prefill"))
    elif kind == "none":
        annotations.append(_note(f"no cache: this step recomputed all {record.input_len} positions "
                                 f"(0..{record.position - 1}); nothing is kept between steps"))
    layout = dict(title=dict(text=title or _title(record, kind, layout_info, classes, fresh, after), font=dict(size=13)),
                  xaxis=dict(title=dict(text=f"physical slot ({_order(kind)})" + _zoomed(view_range, n), standoff=4),
                             range=view_range, **ticks),
                  yaxis=dict(title=dict(text="layer"), autorange="reversed", dtick=1 if num_layers <= 12 else 5,
                             domain=[0, 0.84]),
                  yaxis2=dict(domain=[0.88, 1], anchor="x", tickvals=[0], ticktext=["token"], range=[-0.5, 0.5],
                              fixedrange=True),
                  shapes=shapes, annotations=annotations, height=max(340, 190 + 9 * min(num_layers, 32)),
                  legend=dict(font=dict(size=12), itemclick=False, itemdoubleclick=False, tracegroupgap=2,
                              title=dict(text="slot")),
                  margin=dict(l=60, r=20, t=90, b=50))
    return FigureSpec([heat, names, *legend], hide_axes(layout) if not n else layout)


def _zoomed(view_range: list[float], n: int) -> str:
    shown = int(view_range[1] + 0.5)
    return f" · slots 0..{shown - 1} of {n} shown (autoscale: all)" if shown < n else ""


def _hover(slot: int, pos: int, cls: str, token_texts: Sequence[str]) -> str:
    if pos < 0:
        return f"slot {slot}: {cls}, {SLOT_MEANING[cls]}"
    tok = repr(token_texts[pos]) if pos < len(token_texts) else ""
    return f"slot {slot} · position {pos} {tok}<br>{cls}: {SLOT_MEANING[cls]}"


def _order(kind: str) -> str:
    return {"paged": "pool pages in order", "quantized": "quantized slots, then full-precision residual",
            "sink": "sinks, then the ring", "concat": "grows by one every step"}.get(kind, "storage order")


def _title(record: StepRecord | None, kind: str, info: dict, classes: list[str], fresh: bool = True,
           after: str = "") -> str:
    if record is None:
        return f"{kind}: empty"
    held = sum(c in ("read", "shared", "written", "not read") for c in classes)
    head = f"{kind} · step {record.step} · {held}/{len(classes)} slots held"
    if not fresh and after == "rewind":
        head += f" · after a rewind ({classes.count('stale')} stale)"
    elif not fresh and after:
        head += f" · after a {after}"
    elif record.trace and record.trace.events:
        (w0, wn), (_, rn) = record.trace.events[0].write, record.trace.events[0].read
        if kind == "preallocated":  # literally the tensor windows
            head += f" · write narrow(2, {w0}, {wn}) · read narrow(2, 0, {rn})"
        else:
            wrote = f"position {w0}" if wn == 1 else f"positions {w0}..{w0 + wn - 1}"
            head += f" · wrote {wrote} · attention read {rn} positions"
    if kind == "paged":
        head += f"<br>block table {info.get('block_table')} · {info.get('free_blocks')} free pages"
    elif kind == "sink":
        head += f"<br>{info.get('sinks')} sinks + ring of {info.get('window')} · ring starts at slot {info.get('ring_start')} · {info.get('evicted')} evicted"
    elif kind == "quantized":
        head += f"<br>int{info.get('bits')} blocks of {info.get('group_size')} · positions < {info.get('quantized_upto')} quantized"
    return head


def _note(text: str) -> dict:
    return dict(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font=dict(size=13))


def _vline(x: float, num_layers: int, colour: str = "#444", dash: str = "solid") -> dict:
    return dict(type="line", xref="x", yref="paper", x0=x, x1=x, y0=0, y1=1, line=dict(color=colour, width=1.5, dash=dash))


def _strategy_layout(kind: str, info: dict, n: int, num_layers: int) -> tuple[list, list, dict]:
    """Separators and ticks that show a strategy's own physical layout."""
    shapes, annotations, ticks = [], [], {}
    if kind == "paged" and info.get("block_size"):
        bs = info["block_size"]
        pages = n // bs
        shapes = [_vline(p * bs - 0.5, num_layers, "#888") for p in range(1, pages)]
        step = max(1, pages // 16)
        ticks = dict(tickvals=[p * bs + (bs - 1) / 2 for p in range(0, pages, step)],
                     ticktext=[f"page {p}" for p in range(0, pages, step)])
    elif kind == "sink" and "sinks" in info:
        shapes = [_vline(info["sinks"] - 0.5, num_layers)]
        if info.get("ring_start") is not None:
            shapes.append(_vline(info["ring_start"] - 0.5, num_layers, "#d62728", "dot"))
            annotations.append(dict(text="ring start", x=info["ring_start"] - 0.5, y=1, yref="paper", xref="x",
                                    yanchor="bottom", showarrow=False, font=dict(size=11, color="#d62728")))
    elif kind == "quantized" and "quantized_slots" in info:
        shapes = [_vline(info["quantized_slots"] - 0.5, num_layers)]
        annotations.append(dict(text="full-precision residual →", x=info["quantized_slots"] - 0.5, y=1,
                                xref="x", yref="paper", yanchor="bottom", showarrow=False, xanchor="left",
                                font=dict(size=11)))
    return shapes, annotations, ticks


def from_snapshot(s, lane: str | None = None) -> FigureSpec:
    """The cache map of lane ``lane`` (default: the lane shown) of a :class:`~..snapshot.Snapshot`."""
    ln = s.lanes[lane or s.shown]
    d = ln.detail
    return spec(ln.last, ln.kind, s.config.num_layers, d.texts if d else (), slots=d.slots if d else None,
                fresh=s.fresh, after=s.last_op)


def second_from_snapshot(s) -> FigureSpec:
    """The second strategy's cache map (side by side); empty when there is none."""
    if s.second is None:
        return spec(None, "—", s.config.num_layers, title="pick a second strategy to compare")
    return from_snapshot(s, s.second)
