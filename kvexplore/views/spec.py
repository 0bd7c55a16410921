"""A view's output: a plain description of a plotly figure (plain lists and numbers; tests assert on them), drawn in
the page as it is (:class:`~kvexplore.views.plot.PlotWidget`); :func:`figure` makes a static ``go.Figure`` of it,
which also checks every property against plotly's schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .delta import same


@dataclass
class FigureSpec:
    traces: list[dict[str, Any]]  # each with "type" ("heatmap", "bar", "scatter", "table") and its properties
    layout: dict[str, Any] = field(default_factory=dict)

    def trace(self, name: str) -> dict[str, Any]:
        for t in self.traces:
            if t.get("name") == name:
                return t
        raise KeyError(f"no trace named {name!r}; traces: {[t.get('name') for t in self.traces]}")


def columns(matrix: np.ndarray, keep: np.ndarray | None = None, x0: int = 0,
            rows: Sequence[int] | np.ndarray | None = None) -> dict[str, np.ndarray]:
    """A heatmap's cells as three flat arrays ``x``, ``y``, ``z`` (binary buffers in the browser, where a 2-D ``z``
    would travel as JSON). ``keep`` (a boolean mask like ``matrix``) drops cells never drawn; ``rows`` gives each
    row's y value (default ``0..rows-1``)."""
    h, w = matrix.shape
    ys = np.arange(h, dtype=np.int32) if rows is None else np.asarray(rows, dtype=np.int32)
    yy = np.repeat(ys, w)
    xx = np.tile(np.arange(x0, x0 + w, dtype=np.int32), h)
    z = matrix.reshape(-1)
    if keep is not None:
        flat = keep.reshape(-1)
        xx, yy, z = xx[flat], yy[flat], z[flat]
    return dict(x=xx, y=yy, z=z)


def slot_range(slots: int, highest: int) -> list[float]:
    """The x range for ``slots`` physical slots of which ``highest`` is the last one in use: all of them for a
    small cache, else the used part and some room to grow (a 2048-slot cache holding 9 tokens would be a sliver).
    Plotly's autoscale button still shows everything."""
    if slots <= 128:
        return [-0.5, max(slots, 1) - 0.5]
    return [-0.5, min(slots, max(64, int(1.5 * (highest + 1)) + 8)) - 0.5]


def hide_axes(layout: dict[str, Any]) -> dict[str, Any]:
    """``layout`` with every axis hidden: a view with nothing to draw yet shows its note alone, not empty axes."""
    for key, axis in layout.items():
        if key.startswith(("xaxis", "yaxis")) and isinstance(axis, dict):
            axis["visible"] = False
    return layout


def grid(trace: Any) -> np.ndarray:
    """The 2-D matrix of a heatmap given as :func:`columns` (a trace dict or a plotly trace); cells not sent are 0."""
    get = trace.get if isinstance(trace, dict) else (lambda k: getattr(trace, k))
    x, y, z = (np.asarray(get(k)) for k in ("x", "y", "z"))
    if z.ndim == 2:
        return z
    if z.size == 0:
        return np.zeros((0, 0), dtype=np.float32)
    ys = np.unique(y)
    out = np.zeros((len(ys), int(x.max()) + 1), dtype=z.dtype)
    out[np.searchsorted(ys, y), x] = z
    return out


def figure(spec: FigureSpec):
    """A static ``go.Figure`` drawing ``spec`` (plotly checks every property name and value on the way)."""
    import plotly.graph_objects as go

    kinds = {"heatmap": go.Heatmap, "bar": go.Bar, "scatter": go.Scatter, "table": go.Table}
    traces = [kinds[t["type"]](**{k: v for k, v in t.items() if k != "type"}) for t in spec.traces]
    return go.Figure(data=traces, layout=spec.layout)


def changes(new: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
    """The properties of ``new`` that differ from ``old`` (all of them without ``old``)."""
    return {k: v for k, v in new.items() if k != "type" and (old is None or k not in old or not same(v, old[k]))}
