"""Eviction over the steps, for every lane: the positions each KV head of the chosen layer holds after each step
against the sequence length (a press during decoding draws a sawtooth), from the press state a pressing cache's
records carry (:mod:`kvexplore.trace.press`); and the bytes each lane's cache holds (reserved, used) against what a
full cache of that length holds (:func:`kvexplore.caches.memory.kv_bytes`), so a masking lane shows that it frees
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..trace.records import StepRecord
from .palette import strategy_colour
from .press import empty, press_of
from .spec import FigureSpec

HEAD_DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
BYTES = (("reserved", "reserved_bytes", "solid"), ("used", "logical_bytes", "dash"))
FULL = "#222222"


def _line(name: str, x: list, y: list, colour: str, dash: str, axis: int, group: str, hover: str,
          width: float = 2) -> dict:
    return dict(type="scatter", mode="lines+markers" if len(x) < 40 else "lines", name=name, x=x, y=y,
                xaxis="x" if axis == 1 else f"x{axis}", yaxis="y" if axis == 1 else f"y{axis}", legendgroup=group,
                showlegend=False, line=dict(color=colour, dash=dash, width=width), marker=dict(size=4),
                hovertemplate=f"{hover}<extra></extra>")


def spec(lanes: Mapping[str, Sequence[StepRecord]], layer: int) -> FigureSpec:
    """Two panels over the steps: positions held per KV head of ``layer`` (pressing lanes) and the sequence length;
    bytes held (every lane) and the full cache's bytes."""
    pressing = {name: records for name, records in lanes.items() if any(press_of(r) for r in records)}
    if not pressing:
        return empty("no lane presses: run an evict lane beside the others<br>(strategies=[..., 'evict'])",
                     "eviction over the steps")
    traces = []
    for i, (lane, records) in enumerate(lanes.items()):
        colour = strategy_colour(i)
        traces.append(dict(type="scatter", name=lane, legendgroup=lane, x=[None], y=[None], mode="lines",
                           line=dict(color=colour, width=3), showlegend=True, hoverinfo="skip"))
        steps = [r.step for r in records]
        presses = [press_of(r) for r in records]
        heads = max((len(p.held.get(layer, ())) for p in presses if p is not None), default=0)
        for h in range(heads):
            ys = [p.held[layer][h] if p is not None and layer in p.held else None for p in presses]
            traces.append(_line(f"held · head {h} · {lane}", steps, ys, colour, HEAD_DASHES[h % len(HEAD_DASHES)],
                                1, lane, f"{lane} · layer {layer} KV head {h}<br>step %{{x}}: %{{y}} positions held"))
        for label, attr, dash in BYTES:
            ys = [getattr(r.memory, attr) if r.memory is not None else None for r in records]
            traces.append(_line(f"{label} · {lane}", steps, ys, colour, dash, 2, lane,
                                f"{lane} · {label}<br>step %{{x}}: %{{y:,}} B"))
    first = next(iter(pressing.values()))
    presses = [press_of(r) for r in first]
    steps = [r.step for r, p in zip(first, presses) if p is not None]
    traces.append(_line("sequence length", steps, [p.length for p in presses if p is not None], FULL, "dot", 1,
                        "full", "step %{x}: %{y} positions in the sequence", 1.5))
    traces.append(_line("full cache", steps, [p.full_bytes for p in presses if p is not None], FULL, "dot", 2,
                        "full", "full cache (formula) · step %{x}: %{y:,} B", 1.5))
    traces.append(dict(type="scatter", name="full cache / sequence", legendgroup="full", x=[None], y=[None],
                       mode="lines", line=dict(color=FULL, dash="dot", width=2), showlegend=True,
                       hoverinfo="skip"))
    panels = (f"held per KV head of layer {layer} (dash: head) · sequence ┈",
              "bytes: reserved ━ used ╌ · full cache ┈ (formula)")
    layout = dict(height=640, margin=dict(l=60, r=10, t=60, b=40), hovermode="closest",
                  title=dict(text="eviction over the steps (colour: strategy)", font=dict(size=13)),
                  legend=dict(font=dict(size=12), groupclick="togglegroup", orientation="h", y=-0.22,
                              yanchor="top"),
                  xaxis=dict(domain=[0, 1], anchor="y", title=dict(text=""), showticklabels=False),  # see below
                  yaxis=dict(domain=[0.57, 1.0], anchor="x", rangemode="tozero", title=dict(text="positions")),
                  xaxis2=dict(domain=[0, 1], anchor="y2", matches="x", title=dict(text="step", standoff=2)),
                  yaxis2=dict(domain=[0.0, 0.43], anchor="x2", rangemode="tozero", tickformat="~s", ticksuffix="B"),
                  annotations=[dict(text=text, xref="paper", yref="paper", x=0, y=top, xanchor="left",
                                    yanchor="bottom", showarrow=False, font=dict(size=12))
                               for text, top in zip(panels, (1.0, 0.43))])
    return FigureSpec(traces, layout)


def from_snapshot(s) -> FigureSpec:
    return spec(s.records(), s.layer)
