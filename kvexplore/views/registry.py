"""The explorer's views by name: each a title and a function of a :class:`~.snapshot.Snapshot` to a
:class:`~.views.spec.FigureSpec`. Adding a view is one module in ``views/`` and one line here.

The cache map is always on screen; the views marked ``tab`` share the panel beside it, one at a time (attention
first); ``cache_map_b`` is the second strategy's cache map of the side-by-side mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .snapshot import Snapshot
from . import attention, cache_map, compare, memory, tensors
from .spec import FigureSpec


@dataclass(frozen=True)
class View:
    name: str
    title: str
    build: Callable[[Snapshot], FigureSpec]
    tab: bool = True  # one of the views picked for the panel beside the cache map


VIEWS: dict[str, View] = {v.name: v for v in (
    View("cache_map", "Cache map", cache_map.from_snapshot, tab=False),
    View("attention", "Attention", attention.from_snapshot),
    View("memory", "Memory", memory.from_snapshot),
    View("tensors", "Stored K/V", tensors.from_snapshot),
    View("compare", "Compare strategies", compare.from_snapshot),
    View("cache_map_b", "Second strategy's cache map", cache_map.second_from_snapshot, tab=False),
)}

TABS = tuple(name for name, v in VIEWS.items() if v.tab)
