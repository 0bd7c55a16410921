"""What an explorer lane's records keep of an older step: its slot views as the changes to the step before (a
:class:`SlotChanges`: the slots whose state, position or sharers differ, about 11 bytes each; every
:data:`KEYFRAME`-th view packed whole, 7 bytes a slot) and its read positions as a ``range`` (or an int32 array), so
a long run's records grow with what each step changed, not with the cache's capacity.

:class:`RecentTraces` keeps the newest :data:`KEEP_STEPS` traces as they are (the figures of the current step read
them often) and packs each older one once, against the one packed before it. A packed trace reads the same:
``slots_of`` unpacks (the last few unpacked views are kept, so layers of one kind still share one object),
``reads_of`` gives the compact sequence.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..caches.layout import Layout
from ..caches.slots import FREE, STATES, PackedSlots, SlotView

KEEP_STEPS = 8  # traces kept as they are (a verification of up to 7 drafts gives 8 records; the views read the newest)
KEYFRAME = 64  # a chain of changes is at most this long: then a view is packed whole
_FREE = STATES.index(FREE)
_UNPACKED: "OrderedDict[int, tuple[Any, SlotView]]" = OrderedDict()  # id -> (packed, view): the last few


@dataclass(frozen=True)
class SlotChanges:
    """A slot view stored as what changed since ``base`` (the same layer's view one packed step before): the slots
    whose state, position or sharers differ (``index``, and their new values), and the number of slots (a growing
    cache adds some; slots past the base's count as free, position -1). :meth:`unpack` gives the view back, equal
    to the original."""

    base: Any  # PackedSlots or SlotChanges
    size: int
    index: np.ndarray  # int32: the slots that changed
    states: np.ndarray  # uint8 codes (caches.slots.STATES)
    positions: np.ndarray  # int32
    sharers: np.ndarray  # int16
    layout: Layout
    depth: int  # changes between this view and the whole one its chain starts from

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The view's (states, positions, sharers) as fresh arrays."""
        states, positions, sharers = _arrays(self.base, self.size)
        states[self.index], positions[self.index], sharers[self.index] = self.states, self.positions, self.sharers
        return states, positions, sharers

    def unpack(self) -> SlotView:
        states, positions, sharers = self.arrays()
        return SlotView([STATES[c] for c in states.tolist()], positions.tolist(), sharers.tolist(), self.layout)

    @property
    def nbytes(self) -> int:
        """The bytes of this step's changes (the base's are counted with the base)."""
        return self.index.nbytes + self.states.nbytes + self.positions.nbytes + self.sharers.nbytes


def _arrays(packed, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A packed view's (states, positions, sharers) as fresh arrays of ``size`` slots (cut, or grown with free
    slots)."""
    if isinstance(packed, SlotChanges):
        states, positions, sharers = packed.arrays()
    else:
        states, positions, sharers = packed.states.copy(), packed.positions.copy(), packed.sharers.copy()
    n = states.size
    if n == size:
        return states, positions, sharers
    if n > size:
        return states[:size].copy(), positions[:size].copy(), sharers[:size].copy()
    grow = size - n
    return (np.concatenate([states, np.full(grow, _FREE, np.uint8)]),
            np.concatenate([positions, np.full(grow, -1, np.int32)]), np.concatenate([sharers, np.zeros(grow, np.int16)]))


def pack_slots(view: SlotView, base: Any = None):
    """``view`` packed: as its changes to ``base`` (the same layer's previous packed view) when that is smaller and
    the chain is shorter than :data:`KEYFRAME`, else whole (:class:`~kvexplore.caches.slots.PackedSlots`)."""
    whole = PackedSlots.pack(view)
    depth = base.depth if isinstance(base, SlotChanges) else 0
    if base is None or depth + 1 >= KEYFRAME:
        return whole
    size = whole.states.size
    states, positions, sharers = _arrays(base, size)
    index = np.flatnonzero((states != whole.states) | (positions != whole.positions) | (sharers != whole.sharers))
    if index.size * 11 >= whole.nbytes:
        return whole
    index = index.astype(np.int32)
    layout = base.layout if base.layout == view.layout else view.layout  # a page table changes once a block
    return SlotChanges(base, size, index, whole.states[index], whole.positions[index], whole.sharers[index],
                       layout, depth + 1)


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
    if not isinstance(view, (PackedSlots, SlotChanges)):
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


class PackedEvents(Sequence):
    """A trace's cache events as one row of integers each (int32 where every figure fits): layer, write (first,
    count), read (first, count), storage offset, view, the number of dims, then the read shape and the stride padded
    to the most dims an event has; the keys' data pointers in an int64 array beside. It reads as the list did (each
    :class:`~kvexplore.trace.tracer.CacheEvent` built when asked)."""

    __slots__ = ("rows", "ptrs", "dims", "event")

    def __init__(self, events) -> None:
        self.event = type(events[0]) if len(events) else None  # CacheEvent (kvexplore.trace.tracer imports this module)
        self.dims = max((len(e.read_shape) for e in events), default=0)
        pad = lambda t: [*t, *[0] * (self.dims - len(t))]  # noqa: E731
        rows = np.array([[e.layer, *e.write, *e.read, e.storage_offset, e.view, len(e.read_shape), *pad(e.read_shape),
                          *pad(e.stride)] for e in events], dtype=np.int64).reshape(-1, 8 + 2 * self.dims)
        small = not rows.size or (rows.min() >= np.iinfo(np.int32).min and rows.max() <= np.iinfo(np.int32).max)
        self.rows = rows.astype(np.int32) if small else rows
        self.ptrs = np.array([e.data_ptr for e in events], dtype=np.int64)

    @staticmethod
    def fits(events) -> bool:
        return all(len(e.read_shape) == len(e.stride) for e in events)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        r, d = self.rows[i].tolist(), self.dims
        n = r[7]
        return self.event(layer=r[0], write=(r[1], r[2]), read=(r[3], r[4]), read_shape=tuple(r[8:8 + n]),
                          data_ptr=int(self.ptrs[i]), storage_offset=r[5], stride=tuple(r[8 + d:8 + d + n]),
                          view=bool(r[6]))


class SameRows(Mapping):
    """A trace's attention entries when every layer's is ``(layer, first, end)`` (one decode step's rows of each layer
    in the store): the layers and the two numbers, not a dict of tuples."""

    __slots__ = ("layers", "first", "end")

    def __init__(self, layers: tuple[int, ...], first: int, end: int) -> None:
        self.layers, self.first, self.end = layers, first, end

    @staticmethod
    def of(entries: dict, before: Any = None) -> Any:
        """``entries`` as a :class:`SameRows` when they have that form, else as they are."""
        values = list(entries.values())
        if not values or not all(isinstance(v, tuple) and len(v) == 3 and v[0] == k for k, v in entries.items()) or \
                len({v[1:] for v in values}) != 1:
            return entries
        layers = tuple(entries)
        if isinstance(before, SameRows) and before.layers == layers:
            layers = before.layers
        return SameRows(layers, *values[0][1:])

    def __getitem__(self, layer: int) -> tuple:
        if layer not in self.layers:
            raise KeyError(layer)
        return layer, self.first, self.end

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)


def pack(trace, before=None) -> None:
    """Pack ``trace``'s slot views and read positions in place (objects shared by layers stay shared); each slot view
    as its changes to the same layer's view in ``before`` (the trace packed one step earlier) where that is smaller.
    Its cache events become one array (:class:`PackedEvents`), its attention entries a :class:`SameRows` where they
    can, and its lists of heads the ones ``before`` holds when equal."""
    if not isinstance(trace.events, PackedEvents) and PackedEvents.fits(trace.events):
        trace.events = PackedEvents(trace.events)
    trace.pack_attention(before)
    if before is not None:
        trace.gqa_groups = before.gqa_groups if before.gqa_groups == trace.gqa_groups else trace.gqa_groups
        trace.heads = before.heads if before.heads == trace.heads else trace.heads
    memo: dict[int, object] = {}
    bases = before.layer_slots if before is not None and len(before.layer_slots) == len(trace.layer_slots) else None

    def once(item, make):
        if id(item) not in memo:
            memo[id(item)] = make(item)
        return memo[id(item)]

    def slots(i, v):
        if isinstance(v, (PackedSlots, SlotChanges)):
            return v
        base = bases[i] if bases is not None else None
        return pack_slots(v, base if isinstance(base, (PackedSlots, SlotChanges)) else None)

    trace.layer_slots = [once(v, lambda v, i=i: slots(i, v)) for i, v in enumerate(trace.layer_slots)]
    trace.layer_reads = [once(r, compact_positions) for r in trace.layer_reads]


class RecentTraces:
    """The newest :data:`KEEP_STEPS` traces of a lane; an older one is packed as it leaves."""

    def __init__(self, keep: int | None = None) -> None:
        self._traces: deque = deque()
        self._packed = None  # the trace packed last: the next one is packed as changes to it
        self.keep = KEEP_STEPS if keep is None else keep

    def push(self, trace) -> None:
        compact: dict[int, Any] = {}  # its read positions at once (a range where consecutive): they grow with the context
        for r in trace.layer_reads:
            compact.setdefault(id(r), compact_positions(r))
        trace.layer_reads = [compact[id(r)] for r in trace.layer_reads]
        self._traces.append(trace)
        while len(self._traces) > self.keep:
            older = self._traces.popleft()
            pack(older, self._packed)
            self._packed = older
