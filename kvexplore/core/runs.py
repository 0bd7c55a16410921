"""Runs of consecutive integers, the one way layers, pages and blocks are named in words: ``[3, 4, 5, 9]`` is
``[(3, 5), (9, 9)]``."""

from __future__ import annotations

from collections.abc import Iterable


def runs(values: Iterable[int]) -> list[tuple[int, int]]:
    """Each stretch of ``values`` that goes up by one, as ``(first, last)``, in their order."""
    out: list[list[int]] = []
    for v in values:
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return [(a, b) for a, b in out]
