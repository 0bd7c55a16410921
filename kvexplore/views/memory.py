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
        panels.append((f"held by layer kind · {shown}: logical ━ reserved ┈ (colour: layer kind)", (),
                       f"y{len(panels) + 1}"))
    traces = []
    for i, (lane, records) in enumerate(lanes.items()):
        steps = [r.step for r in records]
        mems = [r.memory for r in records]
        traces.append(dict(type="scatter", name=lane, legendgroup=lane, x=[None], y=[None], mode="lines",
                           line=dict(color=strategy_colour(i), width=3), showlegend=True, hoverinfo="skip"))
        for p, (_, metrics, axis) in enumerate(panels):
            if not metrics:  # the layer-kind panel: drawn once, below, for the lane shown
                continue
            for label, attr, dash in metrics:
                if axis == "y3":
                    ys = [m.cuda_now.get(attr, 0) if m is not None else None for m in mems]
                else:
                    ys = [_figure(m, attr) for m in mems]
                traces.append(dict(
                    type="scatter", mode="lines+markers" if len(steps) < 40 else "lines", name=f"{label} · {lane}",
                    legendgroup=lane, showlegend=False, x=steps, y=ys, xaxis="x" if p == 0 else f"x{p + 1}", yaxis=axis,
                    line=dict(color=strategy_colour(i), dash=dash, width=2), marker=dict(size=4),
                    hovertemplate=f"{lane} · {label}<br>step %{{x}}: %{{y:,}} B<extra></extra>"))
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
    layout = dict(height=260 * n + 60, margin=dict(l=60, r=10, t=60, b=40),
                  title=dict(text="memory per step (colour: strategy · line style: which figure)", font=dict(size=13)),
                  legend=dict(groupclick="togglegroup", font=dict(size=12), title=dict(text="strategy")),
                  hovermode="closest", annotations=[])
    for p, (title, _, _) in enumerate(panels):
        top = 1 - p * (height + gap)
        suffix = "" if p == 0 else str(p + 1)
        layout[f"xaxis{suffix}"] = dict(domain=[0, 1], anchor=f"y{suffix}",
                                        title=dict(text="step" if p == n - 1 else "", standoff=2),
                                        **({} if p == 0 else {"matches": "x"}))
        layout[f"yaxis{suffix}"] = dict(domain=[round(max(0.0, top - height), 6), round(top, 6)], anchor=f"x{suffix}",
                                        tickformat="~s", ticksuffix="B", rangemode="tozero")
        # each panel's name and its line styles, above the panel (a y-axis title that long would not fit)
        layout["annotations"].append(dict(text=title, xref="paper", yref="paper", x=0, y=round(top, 6),
                                          xanchor="left", yanchor="bottom", showarrow=False, font=dict(size=12)))
    return FigureSpec(traces, layout)


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
