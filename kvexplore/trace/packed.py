"""What an explorer lane's records keep of an older step: its slot views packed into arrays and its read positions as
a ``range`` (or an int32 array), so a long run's records do not hold Python lists as long as the cache per step.

:class:`RecentTraces` keeps the newest :data:`KEEP_STEPS` traces as they are (the figures of the current step read
them often) and packs each older one once. A packed trace reads the same: ``slots_of`` unpacks (the last few unpacked
views are kept, so layers of one kind still share one object), ``reads_of`` gives the compact sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np

from ..caches.slots import PackedSlots, SlotView

KEEP_STEPS = 32  # traces kept as they are
_UNPACKED: "OrderedDict[int, tuple[PackedSlots, SlotView]]" = OrderedDict()  # id -> (packed, view): the last few


def compact_positions(reads):
    """``reads`` as a ``range`` when consecutive, else an int32 array (both iterate and index like the list)."""
    if isinstance(reads, (range, np.ndarray)):
        return reads
    a = np.asarray(reads, dtype=np.int64)
    if a.size and np.array_equal(a, np.arange(a[0], a[0] + a.size)):
        return range(int(a[0]), int(a[0]) + a.size)
    return a.astype(np.int32)


def unpacked(view):
    """The :class:`SlotView` of ``view`` (packed or not); one object per packed view while it is among the last few
    asked for."""
    if not isinstance(view, PackedSlots):
        return view
    hit = _UNPACKED.get(id(view))
    if hit is not None and hit[0] is view:
        _UNPACKED.move_to_end(id(view))
        return hit[1]
    out = view.unpack()
    _UNPACKED[id(view)] = (view, out)
    while len(_UNPACKED) > 16:
        _UNPACKED.popitem(last=False)
    return out


def pack(trace) -> None:
    """Pack ``trace``'s slot views and read positions in place (objects shared by layers stay shared)."""
    memo: dict[int, object] = {}

    def once(item, make):
        if id(item) not in memo:
            memo[id(item)] = make(item)
        return memo[id(item)]

    trace.layer_slots = [once(v, lambda v: v if isinstance(v, PackedSlots) else PackedSlots.pack(v))
                         for v in trace.layer_slots]
    trace.layer_reads = [once(r, compact_positions) for r in trace.layer_reads]


class RecentTraces:
    """The newest :data:`KEEP_STEPS` traces of a lane; an older one is packed as it leaves."""

    def __init__(self, keep: int | None = None) -> None:
        self._traces: deque = deque()
        self.keep = KEEP_STEPS if keep is None else keep

    def push(self, trace) -> None:
        self._traces.append(trace)
        while len(self._traces) > self.keep:
            pack(self._traces.popleft())
