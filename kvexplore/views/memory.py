"""Memory timeline: per step and per strategy, the bytes a cache holds and what the step moved.

Top: held (every tensor storage the cache object keeps, :mod:`kvexplore.caches.held`), reserved (for keys and
values), logical (slots holding tokens) and the analytic ``2 * layers * kv_heads * head_dim * element_size * tokens``.
Bottom: bytes written, copied and allocated by the step, on a log scale. On CUDA a third panel shows the caching
allocator's reserved, allocated and inactive split bytes for the whole process. Lines that coincide stay apart
(:func:`_stripes`), and each lane's legend entry names the figures it shares (:func:`_shared`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..trace.records import StepRecord
from .palette import strategy_colour
from .spec import FigureSpec

AFTER_STEP = (("held", "held_bytes", "solid"), ("reserved", "reserved_bytes", "longdash"),
        ("logical", "logical_bytes", "dash"), ("analytic", "analytic_bytes", "dot"))
MOVED = (("written", "written_bytes", "solid"), ("copied", "copied_bytes", "dash"),
         ("allocated", "allocated_bytes", "dot"))
CUDA = (("allocator reserved", "reserved_bytes", "solid"), ("allocator allocated", "allocated_bytes", "dash"),
        ("fragmentation", "inactive_split_bytes", "dot"))


# the bytes a step moves, on a log scale: a decode step's kilobytes beside a prefill's hundreds of megabytes (0 B,
# nothing moved, has no place on it: its line drops off the bottom)
LOG = dict(type="log", dtick=1, title=dict(text="0 B: off scale", font=dict(size=11), standoff=2))  # a tick a decade
KIND_COLOURS = {"full": "#08519c", "sliding": "#31a354", "shared": "#756bb1", "state": "#d94801"}


def spec(lanes: Mapping[str, Sequence[StepRecord]], cuda: bool = False, shown: str | None = None) -> FigureSpec:
    """``lanes``: strategy name -> its records (one per generated token, step 0 being the prefill). When the
    layers keep different caches (full, sliding, shared), one more panel splits lane ``shown``'s bytes by layer
    kind, each from its layers' own reports."""
    panels = [("after the step: held ━ reserved ▬ ▬ logical ╌ analytic ┈", AFTER_STEP, "y"),
              ("moved by the step (log): written ━ copied ╌ allocated ┈", MOVED, "y2")]
    if cuda:
        panels.append(("CUDA caching allocator (whole process): reserved ━ allocated ╌ fragmentation ┈", CUDA, "y3"))
    shown = shown if shown in lanes else next(iter(lanes), None)
    kinds = _kinds(lanes.get(shown, ()))
    if len(kinds) > 1:
        panels.append((f"by layer kind ({shown}): logical ━ reserved ┈", (),
                       f"y{len(panels) + 1}"))
    series = {(lane, axis, attr): (steps, ys) for lane, records in lanes.items()
              for _, metrics, axis in panels for _, attr, _ in metrics
              for steps, ys in [_series(records, attr, axis == "y3")]}
    stripes = _stripes(series)
    traces = []
    for i, (lane, records) in enumerate(lanes.items()):
        shared = _shared(lane, list(lanes), series,
                         [(axis, label, attr) for _, metrics, axis in panels for label, attr, _ in metrics])
        if len(shared) > LEGEND_NOTE:  # the legend's line stays short; the lines' hovers say the rest
            shared = shared[: shared.rfind(",", 0, LEGEND_NOTE) if "," in shared[:LEGEND_NOTE] else LEGEND_NOTE] + ", …"
        traces.append(dict(type="scatter", name=lane + (f" ({shared})" if shared else ""), legendgroup=lane,
                           x=[None], y=[None], mode="lines",
                           line=dict(color=strategy_colour(i), width=3), showlegend=True, hoverinfo="skip"))
        for p, (_, metrics, axis) in enumerate(panels):
            if not metrics:  # the layer-kind panel: drawn once, below, for the lane shown
                continue
            for label, attr, dash in metrics:
                steps, ys = series[lane, axis, attr]
                width, same = stripes[lane, axis, attr]
                also = f" (same as {', '.join(same)})" if same else ""
                traces.append(dict(
                    type="scatter", mode="lines+markers" if len(steps) < 40 else "lines", name=f"{label} · {lane}",
                    legendgroup=lane, showlegend=False, x=steps, y=ys, xaxis="x" if p == 0 else f"x{p + 1}", yaxis=axis,
                    line=dict(color=strategy_colour(i), dash=dash, width=width), marker=dict(size=2 + width),
                    hovertemplate=f"{lane} · {label}{also}<br>step %{{x}}: %{{y:,}} B<extra></extra>"))
    if len(kinds) > 1:
        records = lanes[shown]
        steps = [r.step for r in records]
        axis, xaxis = f"y{len(panels)}", f"x{len(panels)}"
        for group in kinds:
            traces.append(dict(type="scatter", name=f"{group} layers", legendgroup="layer kinds", x=[None], y=[None],
                               mode="lines", line=dict(color=KIND_COLOURS.get(group, "#444"), width=3),
                               showlegend=True, hoverinfo="skip",
                               legendgrouptitle=dict(text=f"layer kind ({shown})")))
            for attr, dash, label in (("logical_bytes", "solid", "logical"), ("reserved_bytes", "dot", "reserved")):
                ys = [r.memory.by_kind().get(group, {}).get(attr) if r.memory is not None else None for r in records]
                traces.append(dict(type="scatter", mode="lines", name=f"{group} layers {label}", x=steps, y=ys,
                                   xaxis=xaxis, yaxis=axis, showlegend=False, legendgroup="layer kinds",
                                   line=dict(color=KIND_COLOURS.get(group, "#444"), dash=dash, width=2),
                                   hovertemplate=f"{group} layers · {label}<br>step %{{x}}: %{{y:,}} B<extra></extra>"))
    n = len(panels)
    gap = 0.14
    height = (1 - gap * (n - 1)) / n
    layout = dict(height=260 * n + 60, margin=dict(l=60, r=10, t=60, b=60),
                  title=dict(text="memory per step (colour: strategy · line style: which figure)", font=dict(size=13)),
                  legend=dict(groupclick="togglegroup", font=dict(size=11), tracegroupgap=0,
                              orientation="h", x=0, xanchor="left", y=-0.16, yanchor="top"),  # under the step axis
                  # keep the figure's width (a legend beside them took a third of a column); the title says its
                  # colours are the strategies, and entries naming what they share take the room of one
                  hovermode="closest", annotations=[])
    for p, (title, metrics, _) in enumerate(panels):
        top = 1 - p * (height + gap)
        suffix = "" if p == 0 else str(p + 1)
        layout[f"xaxis{suffix}"] = dict(domain=[0, 1], anchor=f"y{suffix}",
                                        title=dict(text="step" if p == n - 1 else "", standoff=2),
                                        showticklabels=p == n - 1,  # one step axis, labelled under the last panel
                                        **({} if p == 0 else {"matches": "x"}))
        layout[f"yaxis{suffix}"] = dict(domain=[round(max(0.0, top - height), 6), round(top, 6)], anchor=f"x{suffix}",
                                        tickformat="~s", ticksuffix="B",
                                        **(LOG if metrics is MOVED else dict(rangemode="tozero")))
        # each panel's name and its line styles, above the panel (a y-axis title that long would not fit)
        layout["annotations"].append(dict(text=title, xref="paper", yref="paper", x=0, y=round(top, 6),
                                          xanchor="left", yanchor="bottom", showarrow=False, font=dict(size=12)))
    return FigureSpec(traces, layout)


def _series(records: Sequence[StepRecord], attr: str, cuda: bool) -> tuple[list[int], list[int | None]]:
    """A lane's steps and its figure ``attr`` at each (the allocator's when ``cuda``)."""
    mems = [r.memory for r in records]
    ys = ([m.cuda_now.get(attr, 0) if m is not None else None for m in mems] if cuda else
          [_figure(m, attr) for m in mems])
    return [r.step for r in records], ys


def _stripes(series: Mapping[tuple[str, str, str], tuple[list, list]]) -> dict[tuple[str, str, str], tuple]:
    """Each line's width and the lanes with the same figure at every step: a line that meets later lanes' (the same
    figure above 0 at some step) is 3 px wider than the widest of them, so coinciding lines show as stripes."""
    out: dict[tuple[str, str, str], tuple[int, list[str]]] = {}
    lines: dict[tuple[str, str], list[tuple[str, list, list]]] = {}
    for (lane, axis, attr), (steps, ys) in series.items():
        lines.setdefault((axis, attr), []).append((lane, steps, ys))
    for (axis, attr), drawn in lines.items():
        points = [{(s, y) for s, y in zip(steps, ys) if y} for _, steps, ys in drawn]
        widths = [2] * len(drawn)
        for i in reversed(range(len(drawn))):  # the last drawn is the narrowest
            under = [widths[j] for j in range(i + 1, len(drawn)) if points[i] & points[j]]
            widths[i] = 3 + max(under) if under else 2
        for i, (lane, steps, ys) in enumerate(drawn):
            same = [other for other, s, y in drawn if other != lane and (s, y) == (steps, ys)]
            out[lane, axis, attr] = (widths[i], same)
    return out


LEGEND_NOTE = 40  # characters of a lane's legend note (what it shares with the lanes before it)


def _shared(lane: str, order: list[str], series, lines: list[tuple[str, str, str]]) -> str:
    """What ``lane``'s legend entry says of its ``lines`` (axis, label, attribute) that lie on others at every step:
    the figures it shares with an earlier lane (``= preallocated: held, reserved``: the first such lane, the others
    say theirs) and those of its own that coincide (``logical = analytic``); empty when none do."""
    mine = [(label, series[lane, axis, attr], (axis, attr)) for axis, label, attr in lines]
    mine = [(label, line, key) for label, line, key in mine if any(line[1])]  # all zeros or unknown: not named
    parts = []
    for other in order[: order.index(lane)]:
        same = [label for label, line, key in mine if series[(other, *key)] == line]
        if same:
            parts.append(f"= {other}: {', '.join(same)}")
            break
    own: dict[tuple, list[str]] = {}
    for label, line, (axis, _) in mine:
        own.setdefault((axis, tuple(line[1])), []).append(label)
    return "; ".join(parts + [" = ".join(labels) for labels in own.values() if len(labels) > 1])


def _figure(m, attr: str) -> int | None:
    """``m.attr``, or None where it is not known: no report, or a report saved before held bytes were counted."""
    if m is None or attr == "held_bytes" and not m.held_bytes and m.reserved_bytes:
        return None
    return getattr(m, attr)


def _kinds(records: Sequence[StepRecord]) -> list[str]:
    """The layer kinds of a lane's reports: full, sliding, shared, state in that order, then any registered kind
    (kvexplore.caches.register_layer_kind) in the order the layers have them (drawn in grey)."""
    found = dict.fromkeys(m.kind for r in records if r.memory is not None for m in r.memory.layers)
    return [k for k in KIND_COLOURS if k in found] + [k for k in found if k not in KIND_COLOURS]


def from_snapshot(s) -> FigureSpec:
    return spec(s.records(), cuda=s.cuda, shown=s.shown)
