"""The explorer's plotly ``FigureWidget``s: built once from their views' specs, then updated in place.

An update sends only the properties that changed since the spec a figure shows (:func:`.views.spec.apply`); when a
view's traces change (a lane added or dropped) the same widget gets new traces. When the explorer is displayed,
:meth:`LiveFigures.sync` gives each widget its whole state: updates sent before a figure has a view in the
browser are lost (Voila runs the notebook before the page connects), and plotly resyncs a figure displayed on its
own but not one inside a box.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from .views.spec import FigureSpec, apply, figure, signature


class LiveFigures:
    def __init__(self, specs: dict[str, FigureSpec], width: int) -> None:
        self.widgets: dict[str, Any] = {}
        self._signatures: dict[str, tuple] = {}
        self._shown: dict[str, FigureSpec] = {}  # what each figure shows now
        for name, spec in specs.items():
            fig = figure(spec, widget=True)
            fig.layout.width = width  # plotly cannot size itself inside a widget box (it falls back to 700 px)
            fig.add_class(f"kvx-fig-{name}")
            self.widgets[name] = fig
            self._signatures[name] = signature(spec)
            self._shown[name] = spec

    def update(self, name: str, spec: FigureSpec) -> None:
        """Make figure ``name`` show ``spec``."""
        fig = self.widgets[name]
        previous = self._shown[name]
        sig = signature(spec)
        if sig != self._signatures[name]:
            with fig.batch_update():
                fig.data = ()
                fig.add_traces(figure(spec).data)
            self._signatures[name] = sig
            previous = None
        apply(fig, spec, previous)
        self._shown[name] = spec

    def sync(self) -> None:
        """Give every widget its whole current state (see the module docstring)."""
        for fig in self.widgets.values():
            fig._widget_layout = deepcopy(fig._layout_obj._props)
            fig._widget_data = deepcopy(fig._data)
