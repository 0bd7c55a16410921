"""A prefix cache's history as one self-contained HTML file: a slider (and play) over its frames, each drawing the
block pool, the tree of cached prefixes, the timeline of requests and the frame's story. No kernel, no network:
plotly.js is inside, as in the run replay (:mod:`kvexplore.views.page`, whose packing and player start it reuses).

Each frame's figures are worked out once, here, and travel as data (arrays stored once across frames by
:class:`~kvexplore.views.frames.ArrayStore`, the whole gzip-compressed); the page only draws them.
"""

from __future__ import annotations

import html
import uuid
from typing import Any

import numpy as np

from ..views.frames import ArrayStore
from ..views.page import pack, plotly_script
from ..views.player import UNPACK
from ..views.prefix import extra_figures, figures, frame_label, frames_of, story

PAGE = """<div class="kvx-prefix-page" id="__ID__">
<style>
.kvx-prefix-page {font-family: 'Liberation Sans', Arial, sans-serif; color: #222;}
.kvx-prefix-page h1 {font-size: 20px; margin: 4px 0 8px;}
.kvx-prefix-page .kvx-controls {position: sticky; top: 0; background: #fff; padding: 6px 0; z-index: 10;
  border-bottom: 1px solid #ddd; display: flex; gap: 12px; align-items: center; font-size: 16px;}
.kvx-prefix-page .kvx-slider {flex: 1;}
.kvx-prefix-page .kvx-grid {display: grid; grid-template-columns: 1fr 1fr; gap: 8px; margin-top: 8px;}
</style>
<h1>__TITLE__</h1>
<div class="kvx-controls"><button class="kvx-play">▶ play</button>
<input class="kvx-slider" type="range" min="0" value="0"><span class="kvx-label">loading…</span></div>
<div class="kvx-grid"><div class="kvx-fig-prefix_pool"></div><div class="kvx-fig-prefix_tree"></div>
<div class="kvx-fig-prefix_timeline"></div><div class="kvx-story"></div>__EXTRA__</div>
__PLOTLY__
<script type="application/octet-stream" class="kvx-data">__DATA__</script>
<script>(__PLAYER__)((document.currentScript && document.currentScript.parentElement) || document.getElementById("__ID__"));</script>
</div>"""

PLAYER = "async function (root) {" + UNPACK + r"""
  try {
    const {all, decode} = await unpack(root);
    const frames = all.frames;
    const label = root.querySelector('.kvx-label'), storyBox = root.querySelector('.kvx-story');
    const config = {displaylogo: false, responsive: true};
    const draw = async (i) => {
      const f = frames[i];
      for (const [name, fig] of Object.entries(f.figures)) {
        const d = decode(fig);
        await Plotly.react(root.querySelector('.kvx-fig-' + name), d.data, d.layout, config);
      }
      storyBox.innerHTML = f.story;
      label.textContent = f.label;
      root.dataset.kvxFrame = String(i);
    };
    await wire(root, frames.length, draw, 1200);  // the pool as it ended; the slider goes back to any request
  } catch (e) {
    root.dataset.kvxError = String(e);
    console.error('kvexplore prefix replay:', e);
  }
}"""


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
    """The replay of ``source`` (a PrefixPool or a list of PoolFrames) as one HTML element (see :func:`~kvexplore.replay.prefix_save.save_prefix_html`)."""
    data = page_data(source)
    uid = f"kvx-prefix-{uuid.uuid4().hex[:12]}"
    return (PAGE.replace("__ID__", uid).replace("__TITLE__", html.escape(title or "kvexplore · prefix cache"))
            .replace("__EXTRA__", "".join(f'<div class="kvx-fig-{name}"></div>' for name in extra_figures()))
            .replace("__PLOTLY__", plotly_script() if plotly else "").replace("__DATA__", pack(data))
            .replace("__PLAYER__", PLAYER))
