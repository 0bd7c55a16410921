"""Pools that served the same requests, side by side in one HTML file: each pool's replay (:mod:`.prefix_page`) in a
column, their own sliders hidden, one slider and play button on top moving every column (the page twin of
:class:`kvexplore.explorer.prefix_compare.PrefixCompare`). plotly.js travels once."""

from __future__ import annotations

import html
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..views.page import plotly_script
from ..views.player import UNPACK
from ..views.prefix import side_by_side
from .prefix_page import prefix_fragment

PAGE = """<div class="kvx-prefix-compare-page" id="__ID__">
<style>
.kvx-prefix-compare-page {font-family: 'Liberation Sans', Arial, sans-serif; color: #222;}
.kvx-prefix-compare-page > h1 {font-size: 20px; margin: 4px 0 8px;}
.kvx-prefix-compare-page > .kvx-controls {position: sticky; top: 0; background: #fff; padding: 6px 0; z-index: 20;
  border-bottom: 1px solid #ddd; display: flex; gap: 12px; align-items: center; font-size: 16px;}
.kvx-prefix-compare-page > .kvx-controls .kvx-slider {flex: 1;}
.kvx-prefix-compare-page .kvx-columns {display: flex; gap: 16px; align-items: flex-start;}
.kvx-prefix-compare-page .kvx-columns > .kvx-prefix-page {flex: 1 1 0; min-width: 0;}
.kvx-prefix-compare-page .kvx-columns .kvx-controls {display: none;}
.kvx-prefix-compare-page .kvx-columns .kvx-grid {grid-template-columns: 1fr;}
</style>
<h1>__TITLE__</h1>
<div class="kvx-controls"><button class="kvx-play">▶ play</button>
<input class="kvx-slider" type="range" min="0" value="0"><span class="kvx-label">loading…</span></div>
__PLOTLY__
<div class="kvx-columns">__COLUMNS__</div>
<script>(__LINK__)((document.currentScript && document.currentScript.parentElement) || document.getElementById("__ID__"));</script>
</div>"""

# waits for every column's replay, then one slider (the first .kvx-slider in the page: the one on top) moves them all
LINK = "async function (root) {" + UNPACK + r"""
  try {
    await loadPlotly(root);  // the columns wait for the page's one copy of plotly.js
    const pages = [...root.querySelectorAll('.kvx-columns > .kvx-prefix-page')];
    const settled = (p) => p.dataset.kvxReady === '1' || !!p.dataset.kvxError;
    while (!pages.every(settled)) await new Promise((r) => setTimeout(r, 50));
    const failed = pages.find((p) => p.dataset.kvxError);
    if (failed) throw new Error(failed.dataset.kvxError);
    const count = Math.min(...pages.map((p) => Number(p.querySelector('.kvx-slider').max) + 1));
    const label = root.querySelector('.kvx-label');
    const draw = async (i) => {
      await Promise.all(pages.map((p) => p.kvxShow(i)));
      label.textContent = pages[0].querySelector('.kvx-label').textContent;
      root.dataset.kvxFrame = String(i);
    };
    await wire(root, count, draw, 1200);
  } catch (e) {
    root.dataset.kvxError = String(e);
    console.error('kvexplore prefix comparison:', e);
  }
}"""


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
    return (PAGE.replace("__ID__", f"kvx-prefix-compare-{uuid.uuid4().hex[:12]}")
            .replace("__TITLE__", html.escape(title or "kvexplore · " + " and ".join(named) + " side by side"))
            .replace("__PLOTLY__", plotly_script()).replace("__COLUMNS__", columns).replace("__LINK__", LINK))
