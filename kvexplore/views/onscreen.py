"""What part of an axis is on screen: the range the person zoomed to (``Snapshot.zoom``) or the view's default, cut
to what exists and planned into bins (:mod:`.bins`), with each bin's centre as the x a heatmap cell or a bar is drawn
at. The axis stays in index units (physical slots, positions) whatever the bin size, so a zoom the page reports is
a range of indices, and marks and ticks keep their places.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from .bins import Bins, plan


def zoomed(zoom: Mapping[str, tuple[float, float]] | None, axis: str) -> tuple[float, float] | None:
    """The range ``axis`` was zoomed to (low, high), or None (the view's default)."""
    r = (zoom or {}).get(axis)
    return (min(r), max(r)) if r is not None else None


def indices(r: tuple[float, float], n: int) -> tuple[int, int]:
    """The indices ``start .. stop - 1`` (of ``0 .. n - 1``) whose cells (index ± 0.5) show in the range ``r``."""
    lo, hi = r
    start = max(0, math.floor(lo + 0.5))
    stop = min(n, math.ceil(hi - 0.5) + 1)
    return start, max(start, stop)


def axis_bins(zoom: Mapping[str, tuple[float, float]] | None, axis: str, n: int, default: tuple[float, float],
              max_bins: int) -> tuple[Bins, list[float]]:
    """The bins of the indices on screen along ``axis`` and the axis range to draw (the zoom, else ``default``)."""
    r = zoomed(zoom, axis)
    shown = list(r) if r is not None else list(default)
    start, stop = indices(tuple(shown), n)
    return plan(start, stop, max_bins), shown


def centres(b: Bins) -> np.ndarray:
    """The x of each bin: its index at full resolution (int32), else the middle of the slots it covers (float32)."""
    return b.edges() if b.exact else (b.edges() + (b.size - 1) / 2).astype(np.float32)


def describe(b: Bins, n: int, noun: str = "slots") -> str:
    """A line for an axis title: what is shown and at what resolution."""
    if b.count == 0:
        return ""
    last = b.last(b.count - 1)
    part = f"{noun} {b.start}..{last} of {n} shown" if (b.start, last) != (0, n - 1) else ""
    res = f"bins of {b.size} (zoom in for each one)" if not b.exact else ""
    return " · ".join(x for x in (part, res) if x)
