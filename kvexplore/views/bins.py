"""Binning what is wider than the screen: a figure never sends more columns (or rows) than it can draw.

:func:`plan` gives at most ``max_bins`` aligned power-of-two bins over the part on screen (a bin of size 8 always
covers ``8k .. 8k+7``, so a Step changes the last bin, not every bin); a range no wider than ``max_bins`` is drawn
at full resolution. :func:`reduce` gives each bin's max or mean, :func:`dominant` its most telling category.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

REDUCTIONS = ("max", "mean")


@dataclass(frozen=True)
class Bins:
    """Bins of ``size`` consecutive indices covering ``start .. stop - 1`` (``start`` a multiple of ``size``;
    the last bin may reach past ``stop``: it covers only what exists)."""

    start: int
    stop: int
    size: int

    @property
    def count(self) -> int:
        return max(0, -(-(self.stop - self.start) // self.size))

    @property
    def exact(self) -> bool:
        """One index per bin: full resolution."""
        return self.size == 1

    def edges(self) -> np.ndarray:
        return np.arange(self.start, self.start + self.count * self.size, self.size, dtype=np.int32)

    def last(self, i: int) -> int:
        """The last index bin ``i`` covers (at most ``stop - 1``)."""
        return min(self.start + (i + 1) * self.size, self.stop) - 1

    def label(self, i: int, noun: str = "positions") -> str:
        """``"positions 8–15 (8)"``, or ``"position 3"`` at full resolution."""
        first, last = self.start + i * self.size, self.last(i)
        if first == last:
            return f"{noun.rstrip('s')} {first}"
        return f"{noun} {first}–{last} ({last - first + 1})"


def plan(start: int, stop: int, max_bins: int) -> Bins:
    """The finest aligned power-of-two bins covering ``start .. stop - 1`` in at most ``max_bins`` bins."""
    if max_bins < 1:
        raise ValueError(f"max_bins must be at least 1, got {max_bins}")
    start, stop = max(0, int(start)), max(int(stop), int(start))
    size = 1
    while True:
        first = start - start % size
        if -(-(stop - first) // size) <= max_bins:
            return Bins(first, stop, size)
        size *= 2


def _padded(values: np.ndarray, bins: Bins, fill: float) -> np.ndarray:
    """``values`` (last axis indexed from 0) cut to the bins' span and padded with ``fill`` to whole bins."""
    n = bins.count * bins.size
    out = np.full((*values.shape[:-1], n), fill, dtype=np.float32)
    lo, hi = bins.start, min(bins.stop, values.shape[-1])
    if hi > lo:
        out[..., : hi - lo] = values[..., lo:hi]
    return out.reshape(*values.shape[:-1], bins.count, bins.size)


def reduce(values: np.ndarray, bins: Bins, how: str = "max") -> np.ndarray:
    """Each bin's ``how`` (``"max"`` or ``"mean"``) of ``values`` along the last axis (index 0 = position 0); NaN
    (nothing recorded) is ignored, a bin with nothing recorded is NaN. float32, shape ``(..., bins.count)``."""
    if how not in REDUCTIONS:
        raise ValueError(f"unknown reduction {how!r}; use one of {REDUCTIONS}")
    v = np.asarray(values, dtype=np.float32)
    if bins.exact:
        return _padded(v, bins, np.nan)[..., 0]
    p = _padded(v, bins, np.nan)
    seen = ~np.isnan(p)
    anyseen = seen.any(-1)
    if how == "max":
        out = np.where(seen, p, -np.inf).max(-1)
    else:
        out = np.where(seen, p, 0.0).sum(-1) / np.maximum(seen.sum(-1), 1)
    return np.where(anyseen, out, np.nan).astype(np.float32)


def dominant(codes: np.ndarray, bins: Bins, priority: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per bin, the code of highest ``priority`` among ``codes`` (int, last axis indexed from 0; -1 = none) and how
    many indices of the bin hold it. ``priority[c]`` ranks code ``c`` (higher wins)."""
    c = np.asarray(codes)
    p = _padded(c.astype(np.float32), bins, -1).astype(np.int64)
    rank = np.where(p >= 0, np.asarray(priority)[np.clip(p, 0, None)], -1)
    best = np.take_along_axis(p, rank.argmax(-1)[..., None], -1)[..., 0]
    counts = (p == best[..., None]).sum(-1)
    return best.astype(c.dtype if np.issubdtype(c.dtype, np.integer) else np.int64), counts.astype(np.int32)
