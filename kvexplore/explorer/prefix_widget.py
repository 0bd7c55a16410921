"""A prefix cache in a notebook: :class:`PrefixView` shows a pool's frames (or any list of PoolFrames) under a slider
and play button: the block pool and the tree of cached prefixes side by side, the timeline of requests and the
frame's story under them, each figure a :class:`~kvexplore.views.plot.PlotWidget` (a slider move sends only what
changed). Shown over a live pool, it follows it: each request the pool serves grows the slider and moves it there.
"""

from __future__ import annotations

import html
from typing import Any

from ..errors import SettingsError
from ..prefix.frames import PoolFrame
from ..views.plot import PlotWidget, loader
from ..views.prefix import extra_figures, figures, frame_label, frames_of, story
from . import inspect


class PrefixView:
    """The prefix-cache widget over ``source``: a PrefixPool (anything with ``frames()``; with a ``listeners`` list
    it is followed live) or a list of :class:`~kvexplore.prefix.frames.PoolFrame`. ``frame``: the one shown first
    (default the last). ``interval``: milliseconds between frames when playing."""

    def __init__(self, source: Any, frame: int | None = None, interval: int = 1200) -> None:
        import ipywidgets as W

        self.frames: list[PoolFrame] = frames_of(source)
        shown = len(self.frames) - 1 if frame is None else frame
        if not 0 <= shown < len(self.frames):
            raise SettingsError(f"frame {frame} does not exist: there are frames 0..{len(self.frames) - 1}")
        self.shown = shown
        specs = figures(self.frames, shown)
        self.figures = {name: PlotWidget(spec, name) for name, spec in specs.items()}
        last = len(self.frames) - 1
        self.slider = W.IntSlider(value=shown, min=0, max=last, description="frame", continuous_update=False,
                                  style={"description_width": "initial"},
                                  layout=W.Layout(width="40%", min_width="260px"))
        self.slider.add_class("kvx-prefix-slider")
        self.play = W.Play(value=shown, min=0, max=last, interval=interval, description="play")
        self.play.add_class("kvx-prefix-play")
        W.jslink((self.play, "value"), (self.slider, "value"))
        W.jslink((self.play, "max"), (self.slider, "max"))
        self.label = W.HTML(layout=W.Layout(flex="1 1 300px"))
        self.label.add_class("kvx-prefix-label")
        self.story = W.HTML(layout=W.Layout(flex="1 1 360px", min_width="320px"))
        self.story.add_class("kvx-prefix-story-box")
        self._truth = inspect.element()
        side = {"flex": "1 1 420px", "min_width": "360px"}
        for name, fig in self.figures.items():
            fig.layout = W.Layout(**side) if name != "prefix_timeline" else W.Layout(flex="1 1 480px",
                                                                                     min_width="400px")
        row = dict(flex_flow="row wrap", align_items="flex-start", width="100%")
        parts = [W.HBox([self.play, self.slider, self.label], layout=W.Layout(align_items="center", width="100%")),
                 W.HBox([self.figures["prefix_pool"], self.figures["prefix_tree"]], layout=W.Layout(**row)),
                 W.HBox([self.figures["prefix_timeline"], self.story], layout=W.Layout(**row))]
        if extra := extra_figures():  # figures registered beyond the three (views.prefix.register_prefix_figure)
            parts.append(W.HBox([self.figures[name] for name in extra], layout=W.Layout(**row)))
        parts.append(loader())
        self.widget = W.VBox(parts + ([self._truth] if self._truth is not None else []),
                             layout=W.Layout(width="100%"))
        self.widget.add_class("kvx-prefix-view")
        self._write(shown)
        self.slider.observe(lambda change: self._draw(change["new"]), names="value")
        self.source = source if isinstance(getattr(source, "listeners", None), list) else None
        if self.source is not None:
            self.source.listeners.append(self._on_frame)

    def show(self, i: int) -> None:
        """Draw frame ``i`` (a position in :attr:`frames`); the slider moves there."""
        if not 0 <= i < len(self.frames):
            raise SettingsError(f"frame {i} does not exist: there are frames 0..{len(self.frames) - 1}")
        if self.slider.value != i:
            self.slider.value = i  # (its observer draws)
        else:
            self._draw(i)

    def _draw(self, i: int) -> None:
        self.shown = i
        specs = figures(self.frames, i)
        for name, fig in self.figures.items():
            fig.show(specs[name])
        self._write(i)

    def _write(self, i: int) -> None:
        self.label.value = html.escape(frame_label(self.frames, i))
        self.story.value = story(self.frames, i)
        if self._truth is not None:
            inspect.put(self._truth, self.state())

    def _on_frame(self, frame: PoolFrame) -> None:
        """A pool's listener: the new frame is added, the slider grows and moves to it."""
        if not isinstance(frame, PoolFrame):
            raise SettingsError(f"a listener got a {type(frame).__name__}, not a PoolFrame")
        self.frames.append(frame)
        self.slider.max = self.play.max = len(self.frames) - 1
        self.show(len(self.frames) - 1)

    def specs(self) -> dict[str, Any]:
        """The figures shown now, by name (what the page must draw)."""
        return {name: fig.spec for name, fig in self.figures.items()}

    def state(self) -> dict[str, Any]:
        """What the widget shows, JSON-safe (browser tests compare the page with it)."""
        return {"specs": {name: {"traces": inspect.plain(s.traces), "layout": inspect.plain(s.layout)}
                          for name, s in self.specs().items()},
                "shown": list(self.figures), "frame": self.shown, "frames": len(self.frames), "error": ""}

    def close(self) -> None:
        if self.source is not None and self._on_frame in self.source.listeners:
            self.source.listeners.remove(self._on_frame)
        self.widget.close()

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
