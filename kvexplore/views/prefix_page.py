"""A prefix cache's history as one self-contained HTML file: a slider (and play) over its frames, each drawing the
prefix figures and the frame's story, with no kernel and no network (the run replay's packing and player start,
:mod:`.page`). Pools that served the same requests go side by side under one slider (the page twin of
:class:`kvexplore.explorer.prefix_compare.PrefixCompare`). Each frame's figures travel as data, arrays stored once
(:class:`~kvexplore.views.frames.ArrayStore`) and strings once (:class:`Strings`).
"""

from __future__ import annotations

import html
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..prefix.page_writer import register_page_writer
from . import assets
from .frames import ArrayStore
from .page import document, pack, plotly_script
from .player import on_root
from .prefix import extra_figures, figures, frame_label, frames_of, side_by_side, story

# the page (its __NAMES__ filled in by prefix_fragment) and its player, after the run replay's unpack and wire
PAGE = assets.text(__file__, "prefix_page.html")
PLAYER = on_root(assets.text(__file__, "prefix_page.js"))
# the side-by-side page (its __NAMES__ filled in by compare_fragment) and its script: one slider moves every column
COMPARE_PAGE = assets.text(__file__, "prefix_compare_page.html")
LINK = on_root(assets.text(__file__, "prefix_compare_page.js"))


class Strings:
    """Lists of strings (hover texts, labels) stored once per page: each such list travels as indices into one table
    (``{"$t": indices}``, decoded by the player), since a block's hover text is the same in most frames."""

    SHORTEST = 8  # shorter lists travel as they are

    def __init__(self) -> None:
        self.table: list[str] = []
        self._at: dict[str, int] = {}

    def intern(self, value: Any) -> Any:
        """``value`` with every long list of strings in it replaced by ``{"$t": int32 indices}``."""
        if isinstance(value, dict):
            return {k: self.intern(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            if len(value) >= self.SHORTEST and all(isinstance(v, str) for v in value):
                return {"$t": np.array([self._index(v) for v in value], dtype=np.int32)}
            return [self.intern(v) for v in value]
        return value

    def _index(self, text: str) -> int:
        if text not in self._at:
            self._at[text] = len(self.table)
            self.table.append(text)
        return self._at[text]


def page_data(source: Any) -> dict:
    """What the page carries: every frame's figures (arrays and strings stored once), story and label."""
    frames = frames_of(source)
    store, strings = ArrayStore(), Strings()
    out: list[dict | None] = [None] * len(frames)
    for i in reversed(range(len(frames))):  # last first: earlier arrays are often the start of later ones
        figs = figures(frames, i)
        out[i] = {"figures": {name: store.encode(strings.intern({"data": figs[name].traces,
                                                                 "layout": figs[name].layout}), name)
                              for name in figs},
                  "story": story(frames, i), "label": frame_label(frames, i)}
    return {"arrays": store.arrays, "strings": strings.table, "frames": out}


def prefix_fragment(source: Any, title: str | None = None, plotly: bool = True) -> str:
    """The replay of ``source`` (a PrefixPool or PoolFrames) as one HTML element (:func:`save_prefix_html`)."""
    data = page_data(source)
    uid = f"kvx-prefix-{uuid.uuid4().hex[:12]}"
    return (PAGE.replace("__ID__", uid).replace("__TITLE__", html.escape(title or "kvexplore · prefix cache"))
            .replace("__EXTRA__", "".join(f'<div class="kvx-fig-{name}"></div>' for name in extra_figures()))
            .replace("__PLOTLY__", plotly_script() if plotly else "").replace("__DATA__", pack(data))
            .replace("__PLAYER__", PLAYER))


def several(source: Any) -> bool:
    """Whether ``source`` is several pools (a mapping, or a list of things with ``frames()``), not one pool's frames."""
    if isinstance(source, Mapping):
        return True
    return (isinstance(source, Sequence) and not isinstance(source, (str, bytes)) and bool(source)
            and all(callable(getattr(s, "frames", None)) for s in source))


def compare_fragment(sources: Any, title: str | None = None) -> str:
    """Every pool of ``sources`` (a ``{name: pool}`` mapping or a list of pools, all having served the same number
    of requests) in a column of one element."""
    named = side_by_side(sources)
    columns = "\n".join(prefix_fragment(s, name, plotly=False) for name, s in named.items())
    return (COMPARE_PAGE.replace("__ID__", f"kvx-prefix-compare-{uuid.uuid4().hex[:12]}")
            .replace("__TITLE__", html.escape(title or "kvexplore · " + " and ".join(named) + " side by side"))
            .replace("__PLOTLY__", plotly_script()).replace("__COLUMNS__", columns).replace("__LINK__", LINK))


def save_prefix_html(source: Any, path: str | Path, title: str | None = None) -> Path:
    """Write the replay of ``source``'s frames (a :class:`~kvexplore.prefix.pool.PrefixPool`, anything with
    ``frames()``, or a list of :class:`~kvexplore.prefix.frames.PoolFrame`) to ``path``: one self-contained file
    (what ``PrefixPool.save_html`` and ``kvexplore kv-events --html`` write). Several pools (a ``{name: pool}``
    mapping or a list of pools that served the same requests) are drawn side by side under one slider."""
    path = Path(path)
    body = compare_fragment(source, title) if several(source) else prefix_fragment(source, title)
    path.write_text(document(body, title or "kvexplore · prefix cache"), encoding="utf-8")
    return path


register_page_writer(save_prefix_html)  # PrefixPool.save_html (the prefix folder sits below this one)
