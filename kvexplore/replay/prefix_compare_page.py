"""Pools that served the same requests, side by side in one HTML file: each pool's replay (:mod:`.prefix_page`) in a
column, their own sliders hidden, one slider and play button on top moving every column (the page twin of
:class:`kvexplore.explorer.prefix_compare.PrefixCompare`). plotly.js travels once."""

from __future__ import annotations

import html
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ..views import assets
from ..views.page import plotly_script
from ..views.player import on_root
from ..views.prefix import side_by_side
from .prefix_page import prefix_fragment

# the page (its __NAMES__ filled in by compare_fragment) and its script: one slider moves every column
PAGE = assets.text(__file__, "prefix_compare_page.html")
LINK = on_root(assets.text(__file__, "prefix_compare_page.js"))


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
