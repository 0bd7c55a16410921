"""The ranges a person zoomed each figure to, from the page (plotly's relayout: a box zoom, a pan, the autoscale
button or a double-click, which clears it) or from Python (``explorer.zoom("cache_map", x=(0, 99))``): checked, kept
per figure, and written into a figure's layout so that the page stays where the person put it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from ..errors import SettingsError

Ranges = dict[str, tuple[float, float]]
AXIS = re.compile(r"[xy]axis\d*")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def checked(figure: str, axes: Mapping[str, Any], figures: Mapping[str, Any], layout: Mapping[str, Any]) -> dict:
    """``axes`` (axis name -> (low, high), or None to clear that axis) for ``figure``, checked: the figure must
    exist, each axis must be one of its axes and each range two finite numbers, low below high. Raises
    :class:`SettingsError` naming the problem; returns the ranges as ``(float, float)``."""
    if figure not in figures:
        raise SettingsError(f"no figure {figure!r} to zoom; figures: {', '.join(figures)}")
    have = [k for k, v in layout.items() if AXIS.fullmatch(k) and isinstance(v, dict)]
    out: dict[str, tuple[float, float] | None] = {}
    for axis, r in axes.items():
        if axis not in have:
            raise SettingsError(f"figure {figure!r} has no axis {axis!r}; its axes: {', '.join(have)}")
        if r is None:
            out[axis] = None
            continue
        if not (isinstance(r, (list, tuple)) and len(r) == 2 and all(_number(v) for v in r) and r[0] < r[1]):
            raise SettingsError(f"zoom {figure!r} {axis}: give a range (low, high) of two finite numbers with "
                                f"low < high, got {r!r}")
        out[axis] = (float(r[0]), float(r[1]))
    return out


def merged(current: Ranges, axes: Mapping[str, tuple[float, float] | None]) -> Ranges:
    """``current`` with ``axes`` applied (a None range removes that axis' zoom)."""
    return {axis: r for axis, r in {**current, **axes}.items() if r is not None}


def from_page(ranges: Any) -> dict[str, Any]:
    """What the page reported (axis -> [a, b] or null) as low..high (plotly gives a reversed axis' high first)."""
    if not isinstance(ranges, dict):
        raise SettingsError(f"the page sent a zoom that is not axis -> range: {ranges!r}")
    return {str(k): (None if v is None else tuple(sorted(v)) if isinstance(v, (list, tuple)) and len(v) == 2
                     and all(_number(x) for x in v) else v) for k, v in ranges.items()}


def reversed_axes(layout: Mapping[str, Any]) -> set[str]:
    """The axes of ``layout`` drawn high to low (``autorange="reversed"`` or a range given high first)."""
    out = set()
    for axis, ax in layout.items():
        if AXIS.fullmatch(axis) and isinstance(ax, dict):
            r = ax.get("range")
            if ax.get("autorange") == "reversed" or (isinstance(r, list) and len(r) == 2 and r[0] > r[1]):
                out.add(axis)
    return out


def into_layout(layout: dict, ranges: Ranges, high_first: set[str]) -> dict:
    """``layout`` showing ``ranges``: each zoomed axis' range set and fixed, high first on the axes ``high_first``
    (those the figure draws reversed when not zoomed)."""
    for axis, (lo, hi) in ranges.items():
        ax = layout.get(axis)
        if isinstance(ax, dict):
            ax["range"] = [hi, lo] if axis in high_first else [lo, hi]
            ax["autorange"] = False
    return layout
