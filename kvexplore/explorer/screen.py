"""The explorer's screen (:class:`Screen`): the controls wired to the explorer's operations, and the pickers, panels
and presentation kept in step with the session (the part of :class:`~kvexplore.explorer.widget.Explorer` that only
reacts to the page). It expects of the explorer ``controls``, ``figures``, ``widget``, ``_panel``, ``session``,
``model``, ``layer``/``head``, the operations and ``refresh()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import SettingsError
from ..views.registry import TABS, VIEWS
from ..views.spec import FigureSpec
from . import controls as layout
from . import inspect, zoom


class Screen:
    """Mixed into :class:`~kvexplore.explorer.widget.Explorer`: what the page's controls do to the screen."""

    error: str
    _tab: str  # the tab's view beside the cache map (presenting, the last view picked other than the cache map)
    _busy: bool
    _syncing: bool
    _zoom: dict[str, zoom.Ranges]  # per figure, the axis ranges the person zoomed to
    _reversed: dict[str, set[str]]  # per figure, the axes it draws high to low (as seen while not zoomed)

    def _fit(self, name: str, spec: FigureSpec) -> FigureSpec:
        spec = layout.fit(name, spec, self.controls["side_by_side"].value, self.presentation)
        ranges = self._zoom.get(name, {})
        rev = self._reversed.setdefault(name, set())
        rev.difference_update(a for a in list(rev) if a not in ranges)
        rev.update(a for a in zoom.reversed_axes(spec.layout) if a not in ranges)
        zoom.into_layout(spec.layout, ranges, rev)
        return spec

    def _drawn(self, names, snap) -> dict[str, FigureSpec]:
        """The views ``names`` built from ``snap``, fitted to the screen (stacked maps: .controls.balance)."""
        specs = {name: self._fit(name, VIEWS[name].build(snap)) for name in names}
        if {"cache_map", "cache_map_b"} <= specs.keys() and self.side_by_side and not self.presentation:
            layout.balance(specs["cache_map"], specs["cache_map_b"])
        return specs

    def zoom(self, figure: str, x: tuple[float, float] | None = None, y: tuple[float, float] | None = None,
             **axes: tuple[float, float] | None) -> None:
        """Show ``figure`` over the range ``x`` (and ``y``; other axes by name, e.g. ``xaxis2=(0, 99)``) at full
        resolution once it is narrow enough (see :mod:`kvexplore.views.bins`); with no range, the whole figure
        again. Ranges are in the axis' own units (physical slots, positions). Bad input raises and changes nothing."""
        named = {**({"xaxis": x} if x is not None else {}), **({"yaxis": y} if y is not None else {}), **axes}
        fig = self.figures.get(figure)
        ranges = zoom.checked(figure, named, self.figures, fig.spec.layout if fig is not None else {})
        self._set_zoom(figure, ranges, bool(ranges))

    def _set_zoom(self, figure: str, ranges: zoom.Ranges, keep: bool = True) -> None:
        """``figure``'s zoom merged with ``ranges`` (``keep`` False: cleared), and the figure redrawn."""
        self._zoom[figure] = zoom.merged(self._zoom.get(figure, {}), ranges) if keep else {}
        if not self._zoom[figure]:
            del self._zoom[figure]
        self._redraw_figure(figure)

    def _zoom_message(self, widget: Any, content: Any, _buffers) -> None:
        """The page reports a zoom, pan or autoscale of one figure (see :mod:`.zoom`)."""
        if not (isinstance(content, dict) and content.get("event") == "zoom"):
            return
        try:
            ranges = zoom.from_page(content.get("ranges"))
            checked = zoom.checked(widget.name, ranges, self.figures, widget.spec.layout)
        except SettingsError as e:
            self._show_error(e)
            return
        self._set_zoom(widget.name, checked)

    def _redraw_figure(self, name: str) -> None:
        """Redraw one figure (a zoom changes nothing else) when it is on screen."""
        if self._busy or name not in self.shown():
            return
        names = [name, *(["cache_map", "cache_map_b"] if name.startswith("cache_map") else [])]
        try:  # a cache map with the other: their heights go together
            for n, spec in self._drawn(list(dict.fromkeys(n for n in names if n in self.shown())),
                                       self.snapshot()).items():
                self.figures[n].show(spec)
            inspect.publish(self._truth, self)
        except Exception as e:  # a message from the page has no caller to raise to: show it
            self._show_error(e)

    def _show_error(self, e: Exception) -> None:
        self.error = str(e)
        self.controls["error"].value = layout.error_html(e)

    def _wire(self) -> None:
        w = self.controls

        def safely(fn):  # a button reports its error in the widget; the traceback stays out of the page
            def handler(*_):
                try:
                    fn()
                except Exception:
                    pass
            return handler

        w["prefill"].on_click(safely(lambda: self.prefill()))
        w["step"].on_click(safely(self.step))
        w["run"].on_click(safely(lambda: self.run()))
        w["rewind"].on_click(safely(lambda: self.rewind()))
        w["reset"].on_click(safely(self.reset))
        w["fork"].on_click(safely(lambda: self.fork()))
        w["load"].on_click(safely(lambda: self.load_model(w["model"].value)))
        for name in ("lane", "lane_b"):
            w[name].observe(lambda ch: self._redraw(), names="value")
        w["layer"].observe(lambda ch: self._pick(layer=ch["new"]), names="value")
        w["head"].observe(lambda ch: self._pick(head=ch["new"]), names="value")
        w["view"].observe(lambda ch: None if self._syncing else self._show_view(), names="value")
        w["side_by_side"].observe(lambda ch: self._side_by_side_changed(), names="value")
        w["presentation"].observe(lambda ch: self._apply_presentation(), names="value")
        for name in ("temperature", "top_k", "top_p"):
            w[name].observe(lambda ch: self._sampling_changed(), names="value")
        w["seed"].observe(lambda ch: setattr(self.session, "seed", ch["new"]), names="value")
        self._buttons = [w[n] for n in layout.BUTTONS]
        for fig in self.figures.values():
            fig.on_msg(self._zoom_message)

    def _show_view(self) -> None:
        w = self.controls
        if w["view"].value in TABS:
            self._tab = w["view"].value  # the view a plain screen shows beside the cache map
        name = self.view
        self._panel.children = ([w["maps"]] if self.map_tab else [w["compare"], self.figures[name]]
                                if name == "compare" else [self.figures[name]])
        self._redraw()

    @property
    def map_tab(self) -> bool:
        """Presenting, the cache map's tab is picked (the cache maps fill the panel)."""
        return self.presentation and self.controls["view"].value == layout.MAP_TAB[1]

    def _side_by_side_changed(self) -> None:
        on = self.controls["side_by_side"].value
        self.controls["lane_b"].layout.display = "" if on else "none"
        self.figures["cache_map_b"].layout.display = "" if on else "none"
        self._redraw()

    def _apply_presentation(self) -> None:
        on = self.presentation
        for name in layout.HIDDEN_WHEN_PRESENTING:
            self.controls[name].layout.display = "none" if on else ""
        self.figures["cache_map_b"].layout.display = "" if self.controls["side_by_side"].value else "none"
        layout.columns(self.controls, self.figures, on)
        with self._quiet():  # the cache map's tab comes (picked: what a class looks at first) and goes with it
            self._sync_tabs(picked=layout.MAP_TAB[1] if on else self._tab)
        self._show_view()
        self.widget.remove_class("kvx-presenting")
        if on:
            self.widget.add_class("kvx-presenting")

    def _has_chat(self) -> bool:
        tok = self.model.tokenizer
        return tok is not None and bool(tok.chat_template)

    def _set_enabled(self, enabled: bool) -> None:
        for b in self._buttons:
            b.disabled = not enabled

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """The pickers' observers stand still while the block sets their options (that selects the first one)."""
        self._syncing = True
        try:
            yield
        finally:
            self._syncing = False

    def _sync_lanes(self) -> None:
        names = list(self.session.lanes)
        with self._quiet():
            layout.set_options(self.controls["lane"], names, names[0])
            layout.set_options(self.controls["lane_b"], names, names[min(1, len(names) - 1)])
            self._sync_tabs()

    def _sync_tabs(self, picked: str | None = None) -> None:
        """Tabs for the views that apply to a lane (:attr:`~..views.registry.View.applies` on its records, or
        ``View.live`` on the lane: the press views once a lane has pressed, the speculation view for a lane that
        drafts), and the one on screen (or ``picked``); presenting, the cache map's tab first."""
        picker = self.controls["view"]
        current = picked or picker.value
        lanes = list(self.session.lanes.values())

        def applies(view) -> bool:
            return any(view.drawn_for(lane.history) or (view.live is not None and view.live(lane)) for lane in lanes)

        tabs = [(VIEWS[n].title, n) for n in TABS if n in (current, self._tab) or applies(VIEWS[n])]
        if self.presentation:
            tabs.insert(0, layout.MAP_TAB)
        if list(picker.options) != tabs:
            picker.options = tabs
        picker.value = current

    def _sync_pickers(self) -> None:
        c = self.model.config
        w = self.controls
        with self._quiet():
            layout.set_options(w["layer"], list(range(c.num_layers)), self.layer)
            layout.set_options(w["head"], list(range(c.num_heads)), self.head)
        w["chat"].layout.display = "" if self._has_chat() else "none"

    def _pick(self, layer: int | None = None, head: int | None = None) -> None:
        if self._syncing:
            return
        if layer is not None:
            self.layer = layer
        if head is not None:
            self.head = head
        self._redraw()

    def _redraw(self) -> None:
        if self._busy or self._syncing or not hasattr(self, "_truth"):
            return
        try:
            self.refresh()
        except Exception as e:  # a picker's change has no caller to raise to: show it
            self._show_error(e)

    def _sampling_changed(self) -> None:
        w = self.controls
        try:
            self.session.set_sampling(temperature=w["temperature"].value, top_k=w["top_k"].value or None,
                                      top_p=None if w["top_p"].value >= 1 else w["top_p"].value)
            w["error"].value = ""
        except ValueError as e:
            self._show_error(e)

