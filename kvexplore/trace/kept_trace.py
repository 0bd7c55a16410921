"""How a run's :class:`~kvexplore.trace.files.History` keeps an older step's trace: compact (a slot view as its changes
to the one kept a step before, a :data:`KEYFRAME`-th one whole; docs/tracing.md#a-long-runs-records), rebuilt by
:meth:`KeptTrace.trace` as the :class:`~kvexplore.trace.tracer.StepTrace` it was, its larger fields when first read."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..caches.layout import Layout
from ..caches.slots import EVICTED, FILLED, FREE, SHARED, STALE, SlotView
from .later import build_later
from .tracer import CacheEvent, StepTrace

KEYFRAME = 64  # a chain of changes is at most this long: then a view is kept whole
STATES = (FREE, FILLED, STALE, EVICTED, SHARED)  # a kept view's state codes
_CODE = {s: i for i, s in enumerate(STATES)}
_NAMES = np.array(STATES, dtype=object)
_WHOLE: "OrderedDict[int, tuple[KeptView, tuple[np.ndarray, ...]]]" = OrderedDict()  # id -> (view, its arrays)


@dataclass(frozen=True, eq=False, slots=True)
class KeptView:
    """One layer's slot view kept: whole (``base`` None: ``states``, ``positions`` and ``sharers`` of every slot) or
    as its changes to ``base``, the same layer's view one kept step before (``index``: the slots that changed, and
    their new values; slots past the base's count as free, position -1: a growing cache adds some)."""

    base: "KeptView | None"
    size: int  # slots
    index: np.ndarray | None  # int32: the slots that changed (None: whole)
    states: np.ndarray  # uint8 codes (STATES)
    positions: np.ndarray  # int32
    sharers: np.ndarray  # int16
    layout: Layout
    depth: int  # changes between this view and the whole one its chain starts from

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The view's (states, positions, sharers) as fresh arrays."""
        hit = _WHOLE.get(id(self))
        if hit is not None and hit[0] is self:
            _WHOLE.move_to_end(id(self))
            return tuple(a.copy() for a in hit[1])
        if self.base is None:
            whole = self.states, self.positions, self.sharers
        else:
            whole = _sized(self.base.arrays(), self.size)
            whole[0][self.index], whole[1][self.index], whole[2][self.index] = self.states, self.positions, self.sharers
        remember(self, whole)
        return tuple(a.copy() for a in whole)

    def view(self) -> SlotView:
        """The :class:`SlotView` kept (equal to the one the step recorded)."""
        states, positions, sharers = self.arrays()
        return SlotView(_NAMES[states].tolist(), positions.tolist(), sharers.tolist(), self.layout)

    @property
    def nbytes(self) -> int:
        """The bytes of this view's arrays (a base's are counted with the base)."""
        index = 0 if self.index is None else self.index.nbytes
        return index + self.states.nbytes + self.positions.nbytes + self.sharers.nbytes


def remember(view: KeptView, whole: tuple[np.ndarray, ...]) -> None:
    """Keep ``view``'s whole arrays among the last few (the next step's view is kept against it, and a view asked for
    is often asked again): a chain of changes is not walked again for them."""
    _WHOLE[id(view)] = (view, whole)
    while len(_WHOLE) > 16:
        _WHOLE.popitem(last=False)


def _sized(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], size: int) -> tuple[np.ndarray, ...]:
    """(states, positions, sharers) of ``size`` slots: cut, or grown with free slots."""
    states, positions, sharers = arrays
    n = states.size
    if n >= size:
        return states[:size], positions[:size], sharers[:size]
    grow = size - n
    return (np.concatenate([states, np.full(grow, _CODE[FREE], np.uint8)]),
            np.concatenate([positions, np.full(grow, -1, np.int32)]),
            np.concatenate([sharers, np.zeros(grow, np.int16)]))


def keep_view(view: SlotView, base: KeptView | None = None) -> KeptView:
    """``view`` kept: as its changes to ``base`` (the same layer's view kept one step before) when they are fewer
    bytes and the chain is shorter than :data:`KEYFRAME`, else whole. A layout equal to the base's is the base's
    object (a page table changes once a block)."""
    states = np.array(list(map(_CODE.__getitem__, view.states)), dtype=np.uint8)
    positions, sharers = np.asarray(view.positions, dtype=np.int32), np.asarray(view.sharers, dtype=np.int16)
    layout = base.layout if base is not None and base.layout == view.layout else view.layout
    kept = whole = KeptView(None, states.size, None, states, positions, sharers, layout, 0)
    if base is not None and base.depth + 1 < KEYFRAME:
        old_states, old_positions, old_sharers = _sized(base.arrays(), states.size)
        index = np.flatnonzero((old_states != states) | (old_positions != positions) | (old_sharers != sharers))
        if index.size * 11 < whole.nbytes:
            index = index.astype(np.int32)
            kept = KeptView(base, states.size, index, states[index], positions[index], sharers[index], layout,
                            base.depth + 1)
    remember(kept, (states, positions, sharers))
    return kept


def compact_positions(reads: Any) -> range | np.ndarray:
    """``reads`` as a ``range`` when consecutive, else an int32 array (both iterate and index like the list)."""
    if isinstance(reads, (range, np.ndarray)):
        return reads
    a = np.asarray(reads, dtype=np.int64)
    if a.size and np.array_equal(a, np.arange(a[0], a[0] + a.size)):
        return range(int(a[0]), int(a[0]) + a.size)
    return a.astype(np.int32)


def _rows(events: list[CacheEvent]) -> tuple[np.ndarray, np.ndarray, int] | tuple[CacheEvent, ...]:
    """A step's cache events as one row of integers each (int32 where every figure fits): layer, write (first,
    count), read (first, count), storage offset, view, the number of dims, then the read shape and the stride padded
    to the most dims an event has; the keys' data pointers in an int64 array beside. Events whose shape and stride
    differ in length are kept as they are."""
    if not all(len(e.read_shape) == len(e.stride) for e in events):
        return tuple(events)
    dims = max((len(e.read_shape) for e in events), default=0)
    pad = lambda t: [*t, *[0] * (dims - len(t))]  # noqa: E731
    rows = np.array([[e.layer, *e.write, *e.read, e.storage_offset, e.view, len(e.read_shape), *pad(e.read_shape),
                      *pad(e.stride)] for e in events], dtype=np.int64).reshape(-1, 8 + 2 * dims)
    small = not rows.size or (rows.min() >= np.iinfo(np.int32).min and rows.max() <= np.iinfo(np.int32).max)
    return rows.astype(np.int32) if small else rows, np.array([e.data_ptr for e in events], dtype=np.int64), dims


def _events(kept) -> list[CacheEvent]:
    if not kept or isinstance(kept[0], CacheEvent):
        return list(kept)
    rows, ptrs, d = kept
    return [CacheEvent(layer=r[0], write=(r[1], r[2]), read=(r[3], r[4]), read_shape=tuple(r[8:8 + r[7]]),
                       data_ptr=ptr, storage_offset=r[5], stride=tuple(r[8 + d:8 + d + r[7]]), view=bool(r[6]))
            for r, ptr in zip(rows.tolist(), ptrs.tolist())]


def distinct(items: list) -> tuple[list, tuple[int, ...]]:
    """The distinct objects of ``items`` (layers of one kind share one) and the index of each item's."""
    unique = list({id(item): item for item in items}.values())  # each object where it first stands
    index = {id(item): n for n, item in enumerate(unique)}
    return unique, tuple(index[id(item)] for item in items)


def _same(mine: Any, before: Any) -> Any:
    """``before`` when it equals ``mine`` (one object for what did not change), else ``mine``."""
    return before if before is not None and before == mine else mine


@dataclass(frozen=True, eq=False, slots=True)
class KeptTrace:
    """One step's :class:`StepTrace`, kept compact by its run's history (see the module's docstring)."""

    events: Any  # (rows, data pointers, dims), or the events as they were
    views: tuple[KeptView, ...]  # the distinct slot views
    view_of: tuple[int, ...]  # each layer's view in ``views``
    reads: tuple[tuple[Any, bool], ...]  # the distinct read positions, compact, and whether they were a list
    read_of: tuple[int, ...]
    main_layer: int
    gqa_groups: list[list[int]]
    heads: list[int]
    qkv: dict
    press: Any
    ranks: Any
    attention: Any  # (layers, first, end) when every layer's entry is (layer, first, end); else the entries
    history: Any

    @classmethod
    def of(cls, trace: StepTrace, before: "KeptTrace | None" = None) -> "KeptTrace":
        """``trace`` kept, its views as changes to those of ``before`` (the trace kept one step earlier)."""
        views, view_of = distinct(list(trace.layer_slots))
        bases = [before.views[i] for i in before.view_of] if before is not None and \
            len(before.view_of) == len(view_of) else None
        kept = tuple(keep_view(v, bases[view_of.index(i)] if bases is not None else None) for i, v in enumerate(views))
        reads, read_of = distinct(list(trace.layer_reads))
        entries = trace.entries
        values = list(entries.values())
        attention: Any = dict(entries)
        if values and all(isinstance(v, tuple) and len(v) == 3 and v[0] == k for k, v in entries.items()) and \
                len({v[1:] for v in values}) == 1:
            layers = _same(tuple(entries), before.attention[0] if before is not None and
                           isinstance(before.attention, tuple) else None)
            attention = (layers, *values[0][1:])
        b = before
        return cls(_rows(trace.events), kept, _same(view_of, b and b.view_of),
                   tuple((compact_positions(r), not isinstance(r, (range, np.ndarray))) for r in reads),
                   _same(read_of, b and b.read_of),
                   trace.main_layer, _same(trace.gqa_groups, b and b.gqa_groups), _same(trace.heads, b and b.heads),
                   trace.qkv, trace.press, trace.ranks, attention, trace.history)

    def trace(self) -> StepTrace:
        """The step's trace as it was recorded (its events, slot views and read positions built when first read)."""
        if isinstance(self.attention, tuple):
            layers, first, end = self.attention
            entries = {layer: (layer, first, end) for layer in layers}
        else:
            entries = dict(self.attention)
        out = StepTrace(main_layer=self.main_layer, gqa_groups=self.gqa_groups, heads=self.heads, qkv=dict(self.qkv),
                        press=self.press, ranks=self.ranks, _attention=entries, _history=self.history)
        return build_later(out, events=partial(_events, self.events), layer_slots=self.slot_views,
                           layer_reads=self.read_positions)

    def slot_views(self) -> list[SlotView]:
        """Each layer's slot view (layers that shared one share it again)."""
        views = [v.view() for v in self.views]
        return [views[i] for i in self.view_of]

    def read_positions(self) -> list:
        """Each layer's read positions, as the step recorded them (a list, a range or an array)."""
        reads = [(r.tolist() if isinstance(r, np.ndarray) else list(r)) if was_list else r
                 for r, was_list in self.reads]
        return [reads[i] for i in self.read_of]

    @property
    def nbytes(self) -> int:
        """The bytes of this step's arrays (its events and its slot views' changes)."""
        events = self.events[0].nbytes + self.events[1].nbytes if self.events and \
            not isinstance(self.events[0], CacheEvent) else 0
        return events + sum(v.nbytes for v in self.views)
