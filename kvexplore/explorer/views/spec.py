"""A view's output: a plain description of a plotly figure, built once and then applied in place.

Each view module has a pure function ``spec(...) -> FigureSpec`` from records to trace and layout properties
(plain lists and numbers; tests assert on them). :func:`figure` turns a spec into a ``go.Figure`` (or a
``FigureWidget``) once; :func:`apply` copies a later spec into the same figure inside ``batch_update``, so a step
sends the changed properties to the browser instead of a new figure. A view keeps its number and kinds of traces
fixed for a given set of lanes; only when lanes are added does the controller start a new figure.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class FigureSpec:
    traces: list[dict[str, Any]]  # each with "type" ("heatmap", "bar", "scatter", "table") and its properties
    layout: dict[str, Any] = field(default_factory=dict)

    def trace(self, name: str) -> dict[str, Any]:
        """The trace called ``name`` (for tests and notebooks)."""
        for t in self.traces:
            if t.get("name") == name:
                return t
        raise KeyError(f"no trace named {name!r}; traces: {[t.get('name') for t in self.traces]}")


def _plotly_trace(t: dict[str, Any]):
    import plotly.graph_objects as go

    kinds = {"heatmap": go.Heatmap, "bar": go.Bar, "scatter": go.Scatter, "table": go.Table}
    props = {k: v for k, v in t.items() if k != "type"}
    return kinds[t["type"]](**props)


def figure(spec: FigureSpec, widget: bool = False):
    """A new ``go.Figure`` (or ``go.FigureWidget`` with ``widget=True``) drawing ``spec``."""
    import plotly.graph_objects as go

    cls = go.FigureWidget if widget else go.Figure
    return cls(data=[_plotly_trace(t) for t in spec.traces], layout=spec.layout)


def signature(spec: FigureSpec) -> tuple[tuple[str, str], ...]:
    """What must match for :func:`apply` to update a figure in place: the kinds and names of its traces."""
    return tuple((t["type"], str(t.get("name"))) for t in spec.traces)


def apply(fig, spec: FigureSpec) -> None:
    """Update ``fig`` (built from a spec with the same :func:`signature`) to show ``spec``, in one batch."""
    if len(fig.data) != len(spec.traces):
        raise ValueError(f"figure has {len(fig.data)} traces but the spec has {len(spec.traces)}: build a new figure")
    with fig.batch_update():
        for trace, t in zip(fig.data, spec.traces):
            trace.update({k: v for k, v in t.items() if k != "type"})
        fig.update_layout(spec.layout, overwrite=False)
