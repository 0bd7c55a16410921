"""Cache map: layers x physical slots, coloured by what each slot holds and what this step did with it.

Each layer is drawn in its own layout (its :class:`~kvexplore.caches.SlotView`), in the strategy's own storage order
(pages, quantized slots then residual, sinks then ring); a shared layer has no slots and points at the layer it
reads. What a layout adds (marks, ticks, a line of title) comes from the typed layout itself, so a new strategy draws
with no change here. One row of tokens per kind of layout, on top, names what each slot holds when hovered.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..caches.base import EVICTED, FILLED, FREE, SHARED, STALE, SlotView
from ..caches.layout import EmptyLayout, SharedLayout
from ..core.runs import runs
from ..trace.records import StepRecord
from . import bins, divergence, map_rows, onscreen
from .palette import SLOT_CLASSES, SLOT_COLOURS, SLOT_MEANING, discrete_colorscale
from .snapshot import MAX_BINS
from .lettering import place_title
from .spec import FigureSpec, columns, hide_axes, slot_range

CODE = {name: i for i, name in enumerate(SLOT_CLASSES)}
# which class a bin of slots shows: the most telling one it holds (what this step did first, then what is kept)
RANKED = "taken back > written > read > shared > not read > stale > evicted > free"
PRIORITY = np.array([RANKED.split(" > ")[::-1].index(c) for c in SLOT_CLASSES], dtype=np.int64)
MAX_MARKS = 64  # marks drawn per layout (page boundaries thinned out beyond)
MAX_TICKS = 4  # labelled ticks (pages) on the slot axis: upright, they fit a narrow figure
LEGEND_PX = 62  # the legend's rows of slot classes under the map (three rows in a column of 1280 x 800)


def slot_classes(record: StepRecord, slots: SlotView | None = None, fresh: bool = True,
                 layer: int | None = None) -> list[str]:
    """The class of every physical slot of ``layer`` (see :data:`SLOT_CLASSES`): after ``record``'s step, or in
    ``slots`` (the cache now) with the step's windows marked only when the cache is still as the step left it
    (``fresh``). ``layer`` None: the trace's main layer."""
    trace = record.trace
    layer = trace.main_layer if layer is None else layer
    slots = slots if slots is not None else trace.slots_of(layer)
    written = _write(record, layer) if fresh else range(0)
    read = set(trace.reads_of(layer)) if fresh else {p for p in slots.positions if p >= 0}
    back = taken_back(record, slots, layer) if fresh else range(0)
    out = []
    for slot, (state, pos, sharers) in enumerate(zip(slots.states, slots.positions, slots.sharers)):
        if slot in back and state not in (FILLED, SHARED):
            out.append("taken back")
        elif state in (FILLED, SHARED) and pos >= 0:
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


def rejected(record: StepRecord, layer: int) -> range:
    """The positions ``record``'s verification pass wrote in ``layer`` and took back (its rejected drafts): from
    the length the cache kept to the end of the pass's write; empty for a plain step."""
    return range(0) if record.verification is None else range(record.cache_length, _write(record, layer).stop)


def taken_back(record: StepRecord, slots: SlotView, layer: int) -> range:
    """The physical slots of ``layer`` that held the rejected drafts, where the layout puts position ``p`` in slot
    ``p`` (the pre-allocated cache, the residual-free full layers: the slots stay behind, stale, or free where a
    page went back). A layout that moves positions (a ring, a sink window, a quantized part) restored them by a
    recompute or held them elsewhere: nothing to mark (the speculation view says how)."""
    gone = rejected(record, layer)
    n = record.cache_length
    if not gone or gone.stop > len(slots.positions) or n > len(slots.positions):
        return range(0)
    held = np.asarray(slots.positions[:n])
    return gone if np.array_equal(held, np.arange(n)) else range(0)


def _write(record: StepRecord, layer: int) -> range:
    start, count = next((e.write for e in record.trace.events if e.layer == layer), (0, 0))
    return range(start, start + count)


def _groups(views: Sequence[SlotView], reads: Sequence[list[int]]) -> list[tuple[SlotView, list[int]]]:
    """The layers that draw alike (the same slot view and the same positions read: layers of one kind share both,
    a sparse attention reads its own) and the view each draws."""
    out: dict[tuple[int, int], tuple[SlotView, list[int]]] = {}
    for layer, view in enumerate(views):
        key = (id(view), id(reads[layer]) if reads else 0)
        out.setdefault(key, (view, []))[1].append(layer)
    return list(out.values())


def _by_layout(groups: list) -> list:
    """One entry per distinct slot view, with every layer that has it (for the token rows and the title)."""
    out: dict[int, tuple] = {}
    for view, layers, classes in groups:
        out.setdefault(id(view), (view, [], classes))[1].extend(layers)
    return [(view, sorted(layers), classes) for view, layers, classes in out.values()]


def _token_rows(drawn: list, kinds: dict[int, str]) -> list[tuple]:
    """The token rows over the map: one per kind of layer (full, sliding, ...), from its first layout (the main
    layer's first: where the layers of a kind keep different slots, as an evicting cache's do, the others' rows
    are in the map below); labelled with the kind and its layers' count, or "token" when there is one kind."""
    first: dict[str, tuple] = {}
    count: dict[str, int] = {}
    for view, layers, classes in drawn:
        kind = kinds.get(layers[0], "layer")
        first.setdefault(kind, (view, layers, classes))
        count[kind] = count.get(kind, 0) + len(layers)
    if len(first) == 1:  # one kind: its first layout's row (an evicting cache's: the main layer's kept slots)
        return [(*next(iter(first.values())), "token")]
    return [(view, layers, classes, f"{kind} ({count[kind]})") for kind, (view, layers, classes) in first.items()]


def spec(record: StepRecord | None, strategy: str, num_layers: int, token_texts: Sequence[str] = (),
         title: str = "", slots: Sequence[SlotView] | None = None, fresh: bool = True, after: str = "",
         zoom: dict[str, tuple[float, float]] | None = None, max_bins: int = MAX_BINS,
         diverged: tuple[int, int, str, bool] | None = None) -> FigureSpec:
    """The cache map after ``record``'s step (``None``: before any step). ``token_texts[p]`` names position p.

    ``slots``: the cache's slot view of every layer now (default: those recorded with the step); ``fresh=False``
    when the cache is no longer as the step left it (``after`` a rewind or a fork): the step's windows are then not
    drawn. ``zoom``: the axis ranges on screen (``{"xaxis": (first, last)}`` in slots; default: the used part);
    more than ``max_bins`` slots on screen are binned, each bin coloured by its most telling class
    (:data:`PRIORITY`). ``diverged``: (step, position, reference) where this lane first parts from the reference
    lane: each layer's slot holding that position is ringed, and the title says so."""
    views: list[SlotView] = []
    if record is not None and record.trace is not None:
        recorded = record.trace.layer_slots
        views = list(slots) if slots is not None else [record.trace.slots_of(i) for i in range(num_layers)] \
            if recorded else []
    reads = [record.trace.reads_of(i) for i in range(num_layers)] if views else []
    groups = [(v, layers, slot_classes(record, v, fresh, layers[0]) if v.states else [])
              for v, layers in _groups(views, reads)]
    main_layer = record.trace.main_layer if views else 0
    groups.sort(key=lambda g: main_layer not in g[1])  # the main (first full) layer's layout first
    rows_drawn = [(v, layers, classes) for v, layers, classes in groups if classes]
    layouts = _by_layout(groups)
    drawn = [(v, layers, classes) for v, layers, classes in layouts if classes]
    kinds = {m.layer: m.kind for m in record.memory.layers} if views and record.memory is not None else {}
    n = max((len(c) for _, _, c in drawn), default=0)
    codes = np.full((num_layers, max(n, 1)), -1, dtype=np.int8)
    for _, layers, classes in rows_drawn:
        codes[layers, : len(classes)] = _codes(classes)
    used = [s for _, _, classes in drawn for s, c in enumerate(classes) if c != "free"]
    b, view_range = onscreen.axis_bins(zoom, "xaxis", n, slot_range(n, max(used) if used else 0), max_bins)
    best, _ = bins.dominant(codes, b, PRIORITY)
    keep = best >= 0
    grid = best.astype(np.int8)
    empty = [layer for layer in range(num_layers) if not keep[layer].any()]
    if b.count and empty:  # a layer without slots (shared, state) still needs its row, or plotly stretches its
        grid = grid.astype(np.float32)  # neighbours over it: one blank (NaN) cell defines the row
        grid[empty, 0] = np.nan
        keep[empty, 0] = True
    x = onscreen.centres(b)
    scale = dict(zmin=-0.5, zmax=len(SLOT_CLASSES) - 0.5, colorscale=discrete_colorscale(SLOT_COLOURS))
    gap = 1 if b.count <= 128 else 0
    # cells column by column (slot-major): a Step that fills the next slot appends to the arrays, so what is sent
    # is the few cells that changed at their end (see kvexplore.views.delta), not a shift of every layer's row
    by_slot = columns(grid.T, keep.T)
    cells = dict(x=x[by_slot["y"]], y=by_slot["x"], z=by_slot["z"])
    where = "slot %{x}" if b.exact else f"the {b.size} slots around %{{x}} (colour: the first of {RANKED} in it)"
    heat = dict(type="heatmap", name="slots", **cells, xgap=gap, ygap=1, xaxis="x", hoverongaps=False,
                yaxis="y", hovertemplate=f"layer %{{y}} · {where}<br>(hover the token rows for what it holds)"
                                         "<extra></extra>", showscale=False, **scale)
    traces = [heat]
    labels = []
    rows_of = _token_rows(drawn, kinds)
    for i, (view, layers, classes, label) in enumerate(rows_of):  # one token row per kind of layer
        row, hover = _token_row(view, classes, b, token_texts)
        on = row >= 0
        traces.append(dict(type="heatmap", name="tokens" if i == 0 else f"tokens {i + 1}", z=row[on][None, :],
                           customdata=[[h for h, k in zip(hover, on) if k]], x=x[on], y=[i], xgap=gap,
                           xaxis="x", yaxis="y2", showscale=False, hovertemplate="%{customdata}<extra></extra>",
                           **scale))
        labels.append(label)
    # the legend: one square per slot class (a heatmap has none of its own)
    traces += [dict(type="scatter", name=cls, x=[None], y=[None], mode="markers", xaxis="x", yaxis="y",
                    marker=dict(symbol="square", size=12, color=colour, line=dict(color="#999", width=1)),
                    hoverinfo="skip", showlegend=True) for cls, colour in zip(SLOT_CLASSES, SLOT_COLOURS)]
    if diverged is not None and rows_drawn:
        traces.append(_divergence(rows_drawn, diverged, b, x))
    shapes, annotations = _marks(layouts, n, b)
    main = drawn[0][0].layout if drawn else None
    ticks = {}
    if main is not None and len(drawn) == 1 and (t := main.ticks(n)):
        on = [(v, text) for v, text in zip(*t) if b.start - 0.5 <= v <= b.stop - 0.5]
        on = on[:: -(-len(on) // MAX_TICKS) or 1]  # a narrow figure has room for a few labels only
        ticks = dict(tickvals=[v for v, _ in on], ticktext=[text for _, text in on], tickangle=0)
    if record is None:
        annotations.append(_note("no step yet: enter a prompt and press Prefill"))
    elif not drawn and any(isinstance(v.layout, EmptyLayout) for v, _, _ in layouts):
        annotations.append(_note(f"no cache: this step recomputed all {record.input_len} positions "
                                 f"(0..{record.position - 1}); nothing is kept between steps"))
    order = main.order if main is not None and len(drawn) == 1 else "storage order of each layer"
    rows = max(1, len(rows_of))
    shown = onscreen.describe(b, n)
    title = title or _title(record, strategy, layouts, fresh, after)
    if diverged is not None:
        colour = divergence.DRIFT_COLOUR if diverged[3] else divergence.CHANGE_COLOUR
        title += f"<br><span style='color:{colour}'>{divergence.headline(*diverged)}</span>"
    layout = dict(title=dict(text=title, font=dict(size=13), x=0.01, xanchor="left"),
                  xaxis=dict(title=dict(text=f"physical slot ({order})" + (f"<br>{shown}" if shown else ""),
                                        standoff=4), range=view_range, autorange=False, automargin=True, **ticks),
                  yaxis=dict(title=dict(text="layer"), range=[num_layers - 0.5, -0.5], autorange=False,  # (rings
                             dtick=1 if num_layers <= 12 else 5),  # padded an autorange: layer 0 on top, set here)
                  meta=dict(layers=num_layers),  # what at_height spaces the layer labels by
                  yaxis2=dict(anchor="x", tickvals=list(range(rows)),
                              ticktext=labels or ["token"], range=[rows - 0.5, -0.5], fixedrange=True),
                  shapes=shapes, annotations=annotations, height=max(340, 190 + 9 * min(num_layers, 32)),
                  legend=dict(font=dict(size=12), itemclick=False, itemdoubleclick=False, tracegroupgap=2,
                              title=dict(text="slot"), orientation="h", x=0, xanchor="left", yref="container",
                              y=0.005, yanchor="bottom"),  # at the foot of the figure: the map keeps its width
                  margin=dict(l=60 if rows == 1 else 90, r=20, t=0, b=50 + (18 if shown else 0) + LEGEND_PX))
    place_title(layout, below=8)
    map_rows.at_height(layout, layout["height"])
    return FigureSpec(traces, hide_axes(layout) if not n else layout)


def _codes(classes: Sequence[str]) -> np.ndarray:
    return np.array([CODE[c] for c in classes], dtype=np.int8)


def _token_row(view: SlotView, classes: list[str], b, token_texts: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """A layout's token row over the bins ``b`` (-1 where it has no slots) and each bin's hover: at full resolution
    the slot's position and token, binned the slots it covers, how many of each class and the positions held."""
    codes = _codes(classes)
    best, _ = bins.dominant(codes, b, PRIORITY)
    if b.exact:
        return best, [_hover(s, view.positions[s], classes[s], token_texts) if k >= 0 else ""
                      for s, k in zip(b.edges().tolist(), best.tolist())]
    lo, hi = b.start, min(b.stop, len(codes))
    which = (np.arange(lo, hi) - lo) // b.size
    counts = np.zeros((b.count, len(SLOT_CLASSES)), dtype=np.int64)
    np.add.at(counts, (which, codes[lo:hi]), 1)
    pos = np.asarray(view.positions[lo:hi], dtype=np.int64)
    held = pos >= 0
    first = np.full(b.count, np.iinfo(np.int64).max)
    last = np.full(b.count, -1)
    np.minimum.at(first, which[held], pos[held])
    np.maximum.at(last, which[held], pos[held])
    hover = []
    for i in range(b.count):
        if best[i] < 0:
            hover.append("")
            continue
        parts = ", ".join(f"{counts[i, c]} {SLOT_CLASSES[c]}" for c in np.argsort(-PRIORITY) if counts[i, c])
        held_text = f"; positions {first[i]}–{last[i]}" if last[i] >= 0 else ""
        hover.append(f"{b.label(i, 'slots')}: {parts}{held_text}<br>colour: {SLOT_CLASSES[best[i]]}, "
                     f"the first of {RANKED}")
    return best, hover


def _marks(groups, n: int, b) -> tuple[list[dict], list[dict]]:
    """Each layout's marks over the rows of its layers (those on screen, at most :data:`MAX_MARKS` per layout: a
    paged cache of thousands of slots has hundreds of page boundaries), and a note on every row whose layer has no
    slots (a shared layer pointing at its source, a linear-attention layer's fixed state)."""
    shapes, annotations = [], []
    for view, layers, _ in groups:
        if not view.states:
            label = "shared: " if isinstance(view.layout, SharedLayout) else ""
            for layer in layers if view.layout.summary() else []:
                annotations.append(dict(text=label + view.layout.summary(),
                                        x=-0.5, y=layer, xref="x", yref="y", xanchor="left", showarrow=False,
                                        font=dict(size=10, color="#555")))
            continue
        marks = [m for m in view.layout.marks(len(view.states)) if b.start <= m.at <= b.stop]
        marks = marks[:: -(-len(marks) // MAX_MARKS) or 1]
        for first, last in runs(layers):
            for mark in marks:
                shapes.append(dict(type="line", xref="x", yref="y", x0=mark.at - 0.5, x1=mark.at - 0.5,
                                   y0=first - 0.5, y1=last + 0.5, line=dict(color=mark.colour, width=1.5,
                                                                             dash=mark.dash)))
                if mark.label and first == layers[0]:  # beside the line, on the side with room (not past the edge)
                    side = "right" if mark.at > (b.start + b.stop) / 2 else "left"
                    annotations.append(dict(text=mark.label, x=mark.at - 0.5, y=first - 0.5, xref="x", yref="y",
                                            yanchor="bottom", xanchor=side, showarrow=False,
                                            font=dict(size=11, color=mark.colour)))
    return shapes, annotations


def _hover(slot: int, pos: int, cls: str, token_texts: Sequence[str]) -> str:
    if pos < 0:
        return f"slot {slot}: {cls}, {SLOT_MEANING[cls]}"
    tok = repr(token_texts[pos]) if pos < len(token_texts) else ""
    return f"slot {slot} · position {pos} {tok}<br>{cls}: {SLOT_MEANING[cls]}"


def _title(record: StepRecord | None, strategy: str, groups, fresh: bool = True, after: str = "") -> str:
    if record is None:
        return f"{strategy}: empty"
    main = next(((v, layers, c) for v, layers, c in groups if c), None)
    classes = main[2] if main else []
    held = main[0].held if main else 0  # the status line's figure (SlotView.held of the same view)
    head = f"{strategy} · step {record.step} · {held}/{len(classes)} slots held"
    if not fresh and after == "rewind":
        head += f" · after a rewind ({classes.count('stale')} stale)"
    elif not fresh and after:
        head += f" · after a {after}"
    lines, shared = [], []
    if (fresh or not after) and record.trace and record.trace.events and main is not None:  # the step's windows
        event = next((e for e in record.trace.events if e.layer == main[1][0]), record.trace.events[0])
        lines.append(main[0].layout.step(event.write, event.read[1], event.view))
    gone = rejected(record, main[1][0]) if fresh and main is not None and record.trace else range(0)
    if record.verification is not None and fresh:
        lines.append(f"verification: {record.input_len - 1} drafted · "
                     + (f"positions {gone.start}–{gone.stop - 1} written, then taken back" if gone else
                        "every draft accepted, nothing taken back"))
    said: dict[str, list[int]] = {}  # each summary once, with every layer it describes (the x axis gives the order)
    for view, layers, _ in groups:
        if isinstance(view.layout, SharedLayout):  # one line for every shared layer
            shared += [f"{layer} reads {view.layout.source}" for layer in layers]
            continue
        summary = view.layout.summary()
        if summary:
            said.setdefault(summary, []).extend(layers)
    for summary, layers in said.items():
        if len(groups) > 1:
            layers = sorted(layers)
            summary = f"{f'layer {layers[0]}' if len(layers) == 1 else f'layers {_span(layers)}'}: {summary}"
        lines.append(summary)
    if shared:
        lines.append(f"shared layers store nothing: {', '.join(shared[:6])}{', ...' if len(shared) > 6 else ''}")
    return "<br>".join([head, *lines[:4]])


def _span(layers: list[int]) -> str:
    found = runs(layers)
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in found[:4])
    return text + (", ..." if len(found) > 4 else "")


def _divergence(rows: list, diverged: tuple[int, int, str, bool], b, x: np.ndarray) -> dict:
    """Rings round the slot (the bin) of every layer that holds the position where the lane first parted."""
    step, position, reference, drift = diverged
    xs, ys = [], []
    for view, layers, _ in rows:
        if position in view.positions:
            slot = view.positions.index(position)
            if b.start <= slot < b.stop:
                xs += [float(x[(slot - b.start) // b.size])] * len(layers)
                ys += list(layers)
    return dict(type="scatter", name="first divergence", x=xs, y=ys, mode="markers", xaxis="x", yaxis="y",
                marker=dict(symbol="circle-open", size=13, color=divergence.DRIFT_COLOUR if drift else
                            divergence.CHANGE_COLOUR, line=dict(width=2)), showlegend=False,
                hovertemplate=f"{divergence.words(step, position, reference, drift)}<br>layer %{{y}}<extra></extra>")


def _note(text: str) -> dict:
    return dict(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False, font=dict(size=13))


def from_snapshot(s, lane: str | None = None, figure: str = "cache_map") -> FigureSpec:
    """The cache map of lane ``lane`` (default: the lane shown) of a :class:`~..snapshot.Snapshot`."""
    name = lane or s.shown
    ln = s.lanes[name]
    d = ln.detail
    parted = None if name == s.reference else divergence.first_divergence(ln.history, ln.kl, ln.top1)
    return spec(ln.last, ln.kind, s.config.num_layers, d.texts if d else (), slots=d.slots if d else None,
                fresh=s.fresh, after=s.last_op, zoom=s.zoom.get(figure), max_bins=s.max_bins,
                diverged=None if parted is None else (*parted, s.reference,
                                                      divergence.drift_only(ln.top1, ln.history, parted[0])))


def second_from_snapshot(s) -> FigureSpec:
    """The second strategy's cache map (side by side); empty when there is none."""
    if s.second is None:
        return spec(None, "—", s.config.num_layers, title="pick a second strategy to compare")
    return from_snapshot(s, s.second, "cache_map_b")
