"""Memory timeline: per step and per strategy, the bytes a cache holds and what the step moved.

Top: held (every tensor storage the cache object keeps: its keys and values, undo scratch, page tables, positions,
masks, press scores, checkpoints; see :mod:`kvexplore.caches.held`), reserved (the storage meant for keys and values),
logical (slots holding tokens) and the analytic ``2 * layers * kv_heads * head_dim * element_size * tokens``. Bottom: bytes written, copied and allocated by
the step. On CUDA a third panel shows the caching allocator's reserved and allocated bytes and its inactive split
bytes (fragmentation) after each step, for the whole process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..trace.records import StepRecord
from .palette import strategy_colour
from .spec import FigureSpec

HELD = (("held", "held_bytes", "solid"), ("reserved", "reserved_bytes", "longdash"),
        ("logical", "logical_bytes", "dash"), ("analytic", "analytic_bytes", "dot"))
MOVED = (("written", "written_bytes", "solid"), ("copied", "copied_bytes", "dash"),
         ("allocated", "allocated_bytes", "dot"))
CUDA = (("allocator reserved", "reserved_bytes", "solid"), ("allocator allocated", "allocated_bytes", "dash"),
        ("fragmentation", "inactive_split_bytes", "dot"))


KIND_COLOURS = {"full": "#08519c", "sliding": "#31a354", "shared": "#756bb1", "state": "#d94801"}


def spec(lanes: Mapping[str, Sequence[StepRecord]], cuda: bool = False, shown: str | None = None) -> FigureSpec:
    """``lanes``: strategy name -> its records (one per generated token, step 0 being the prefill). When the
    layers keep different caches (full, sliding, shared), one more panel splits lane ``shown``'s bytes by layer
    kind, each from its layers' own reports."""
    panels = [("after the step: held ━ reserved ▬ ▬ logical ╌ analytic ┈", HELD, "y"),
              ("moved by the step: written ━ copied ╌ allocated ┈", MOVED, "y2")]
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
        traces.append(dict(type="scatter", name=lane, legendgroup=lane, x=[None], y=[None], mode="lines",
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
    same_held = _same_held(lanes, stripes)
    if same_held:
        panels[0] = (panels[0][0] + f" · same held bytes: {same_held}", *panels[0][1:])
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
                  legend=dict(groupclick="togglegroup", font=dict(size=12), title=dict(text="strategy"),
                              orientation="h", x=0, xanchor="left", y=-0.1, yanchor="top"),  # under: the panels
                  # keep the figure's width (a legend beside them took a third of a column)
                  hovermode="closest", annotations=[])
    for p, (title, _, _) in enumerate(panels):
        top = 1 - p * (height + gap)
        suffix = "" if p == 0 else str(p + 1)
        layout[f"xaxis{suffix}"] = dict(domain=[0, 1], anchor=f"y{suffix}",
                                        title=dict(text="step" if p == n - 1 else "", standoff=2),
                                        showticklabels=p == n - 1,  # one step axis, labelled under the last panel
                                        **({} if p == 0 else {"matches": "x"}))
        layout[f"yaxis{suffix}"] = dict(domain=[round(max(0.0, top - height), 6), round(top, 6)], anchor=f"x{suffix}",
                                        tickformat="~s", ticksuffix="B", rangemode="tozero")
        # each panel's name and its line styles, above the panel (a y-axis title that long would not fit)
        layout["annotations"].append(dict(text=title, xref="paper", yref="paper", x=0, y=round(top, 6),
                                          xanchor="left", yanchor="bottom", showarrow=False, font=dict(size=12)))
    return FigureSpec(traces, layout)


def _series(records: Sequence[StepRecord], attr: str, cuda: bool) -> tuple[list[int], list[int | None]]:
    """A lane's steps and its figure ``attr`` at each (the allocator's when ``cuda``)."""
    mems = [r.memory for r in records]
    ys = [m.cuda_now.get(attr, 0) if m is not None else None for m in mems] if cuda else [_figure(m, attr) for m in mems]
    return [r.step for r in records], ys


def _stripes(series: Mapping[tuple[str, str, str], tuple[list, list]]) -> dict[tuple[str, str, str], tuple]:
    """Each line's width and the lanes whose line it lies on: lanes with the same figure at every step draw one
    line, so each is drawn narrower than the one below it (the first 2 px wider per lane on it) and every colour
    shows as a stripe; the hover names the others."""
    out: dict[tuple[str, str, str], tuple[int, list[str]]] = {}
    groups: dict[tuple, list[str]] = {}
    for (lane, axis, attr), (steps, ys) in series.items():
        groups.setdefault((axis, attr, tuple(steps), tuple(ys)), []).append(lane)
    for (axis, attr, _, _), same in groups.items():
        for k, lane in enumerate(same):
            out[lane, axis, attr] = (2 + 3 * (len(same) - 1 - k), [o for o in same if o != lane])
    return out


def _same_held(lanes: Mapping[str, Sequence[StepRecord]], stripes) -> str:
    """The lanes whose held bytes are equal at every step, as "a = b; c = d" (empty when every lane differs)."""
    sets = dict.fromkeys(tuple([lane, *stripes[lane, "y", "held_bytes"][1]]) for lane in lanes
                         if stripes[lane, "y", "held_bytes"][1])
    seen, groups = set(), []
    for group in sets:
        key = frozenset(group)
        if key not in seen:
            seen.add(key)
            groups.append(" = ".join(sorted(group, key=list(lanes).index)))
    return "; ".join(groups)


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
