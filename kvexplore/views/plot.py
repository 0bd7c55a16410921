"""A plotly figure in the page that always shows the kernel's whole figure: one synced state, drawn with
``Plotly.react``.

Two synced traits (numeric arrays as binary buffers): ``base``, a whole figure, and ``patch``, what changed since that
base (:mod:`.delta`); a view made at any time draws ``base`` + ``patch`` and nothing is lost between messages, and the
figure is sent as a new base once the patch weighs more than :data:`REBASE` of it. plotly.js travels once per page,
in a hidden :class:`PlotlyLoader`. Why not plotly's ``FigureWidget``: docs/explorer.md ("How the page stays true").
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Any

import anywidget
import numpy as np
import traitlets

from . import assets
from .delta import APPLY_JS, apply, diff, weight
from .spec import FigureSpec, changes, figure

REBASE = 0.5  # a patch heavier than this share of its figure is sent as a new base instead, and so is one once
# the patches sent since the base add up to more than the figure (each re-sends the changes before it: a new base
# then costs less than carrying them on)

# the loader's module runs the page's copy of plotly.js once; a figure's module is one text (anywidget takes one):
# the page's apply() (delta.js: applyPatch), then the figure's own code
_LOADER_ESM = assets.path(__file__, "plot_loader.js")
_FIGURE_ESM = APPLY_JS + assets.text(__file__, "plot_figure.js")


def _to_json(value: Any, widget: Any = None) -> Any:  # (ipywidgets passes the widget too)
    """A figure as JSON with binary buffers: 1-D numeric arrays (not 64-bit integers) as ``{buffer, dtype, shape}``,
    other arrays as lists, numpy scalars as numbers, NaN as null."""
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v) for v in value]
    if isinstance(value, np.ndarray):
        small_int = np.issubdtype(value.dtype, np.integer) and value.dtype.itemsize <= 4  # not int64
        if value.ndim == 1 and (small_int or value.dtype.char in "efd"):  # a typed array in the page
            a = np.ascontiguousarray(value)
            return {"buffer": memoryview(a), "dtype": str(a.dtype), "shape": list(a.shape)}
        return _to_json(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


class PlotlyLoader(anywidget.AnyWidget):
    """Hidden: brings plotly.js (the installed plotly package's copy) into the page once, sent when the page asks
    (a message, not a synced trait: nbclient saves every widget's state into an executed notebook, and 4.7 MB of
    plotly.js there would make it too big to commit)."""

    _esm = _LOADER_ESM

    def __init__(self) -> None:
        super().__init__()
        self.add_class("kvx-plotly-loader")
        self.on_msg(self._answer)

    def _answer(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("want") == "plotly":
            from plotly.offline import get_plotlyjs

            self.send({"plotly": get_plotlyjs()})


_loader: PlotlyLoader | None = None


def loader() -> PlotlyLoader:
    """The kernel's one loader (every explorer shows the same widget; the page runs plotly.js once)."""
    global _loader
    if _loader is None:
        _loader = PlotlyLoader()
    return _loader


class PlotWidget(anywidget.AnyWidget):
    """A figure drawn from a :class:`~.views.spec.FigureSpec`; :meth:`show` replaces what it draws.

    ``data`` and ``plot_layout`` give the figure shown as plotly objects (built when asked), for tests and notebooks."""

    _esm = _FIGURE_ESM
    base = traitlets.Dict().tag(sync=True, to_json=_to_json)  # a whole figure and its revision ("rev")
    patch = traitlets.Dict().tag(sync=True, to_json=_to_json)  # what changed since ``base`` (same "rev")

    def __init__(self, spec: FigureSpec, name: str) -> None:
        super().__init__()
        self.name = name
        self._carried = 0  # the weight of the patches sent since the base
        self.add_class(f"kvx-fig-{name}")
        self.layout.width = "100%"
        self.show(spec, force=True)

    def show(self, spec: FigureSpec, force: bool = False) -> bool:
        """Draw ``spec``; nothing is sent when it equals what is drawn, else what changed since the base (or a new
        base). True when the page was sent something."""
        if not force and len(spec.traces) == len(self.spec.traces) and all(
                x.keys() == y.keys() and not changes(x, y)
                for x, y in [*zip(spec.traces, self.spec.traces), (spec.layout, self.spec.layout)]):
            return False
        self.spec = spec
        self.__dict__.pop("_plotly", None)
        new = {"data": spec.traces, "layout": spec.layout}  # (the page sets the width: its container's)
        patch = None if force else diff(self.base, new)
        size, whole = (weight(patch), weight(new)) if patch is not None else (0, 0)
        if patch is not None and size <= REBASE * whole and self._carried + size <= whole:
            self._carried += size
            self.patch = {**patch, "rev": self.base["rev"]}
            return True
        self._carried = 0
        rev = self.base.get("rev", 0) + 1
        with self.hold_sync():  # one message: the page never sees the new base with the old patch
            self.base = {**new, "rev": rev}
            self.patch = {"rev": rev}
        return True

    @property
    def figure(self) -> dict[str, Any]:
        """The figure the page draws: the base with the patch applied."""
        return apply(self.base, self.patch)

    @cached_property
    def _plotly(self):
        return figure(self.spec)

    @property
    def data(self):
        return self._plotly.data

    @property
    def plot_layout(self):
        """The figure's plotly layout (``layout`` is the widget's own ipywidgets layout)."""
        return self._plotly.layout
