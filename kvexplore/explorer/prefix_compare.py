"""Pools that served the same requests, side by side: :class:`PrefixCompare` shows one :class:`PrefixView` per pool
(its block pool, tree, timeline and story in a column) under one slider, so the hash chain and the radix tree can be
read against each other request by request. ``kvexplore.PrefixPool.serve_each`` serves one request to every pool."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..views.prefix import side_by_side
from .prefix_widget import PrefixView


class PrefixCompare:
    """``sources``: two or more pools (or lists of frames), as a list or a ``{name: pool}`` mapping (the names head
    the columns). The first view's slider and play button move every view; a pool serving a request while shown
    grows its own view, and the slider follows once every pool has served it."""

    def __init__(self, sources: Sequence[Any] | Mapping[str, Any], frame: int | None = None,
                 interval: int = 1200) -> None:
        import ipywidgets as W

        named = side_by_side(sources)
        self.views = {name: PrefixView(s, frame, interval) for name, s in named.items()}
        lead, *rest = self.views.values()
        self.slider, self.play = lead.slider, lead.play
        controls = lead.widget.children[0]  # one slider, play button and label, above the columns
        for view in self.views.values():
            view.widget.children = view.widget.children[1:]
        lead.slider.observe(lambda change: self._follow(change["new"]), names="value")
        self._listening = [view.source for view in rest if view.source is not None]
        for pool in self._listening:  # a later pool's new request: back to the lead's frame (it may be elsewhere)
            pool.listeners.append(self._catch_up)
        columns = [W.VBox([W.HTML(f"<b style='font-size:15px'>{name}</b>"), view.widget],
                          layout=W.Layout(flex="1 1 0", min_width="480px")) for name, view in self.views.items()]
        self.widget = W.VBox([controls, W.HBox(columns, layout=W.Layout(flex_flow="row wrap", width="100%",
                                                                         align_items="flex-start"))],
                             layout=W.Layout(width="100%"))
        self.widget.add_class("kvx-prefix-compare")

    def _catch_up(self, frame) -> None:
        self._follow(self.slider.value)

    def _follow(self, i: int) -> None:
        for view in list(self.views.values())[1:]:
            j = min(i, len(view.frames) - 1)
            if view.shown != j:
                view.show(j)

    def show(self, i: int) -> None:
        next(iter(self.views.values())).show(i)
        self._follow(i)

    def close(self) -> None:
        for pool in self._listening:
            if self._catch_up in pool.listeners:
                pool.listeners.remove(self._catch_up)
        for view in self.views.values():
            view.close()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
