"""Older steps' records kept as the changes to the step before: every packed slot view reads back equal to the view
the step recorded, on caches whose slots move in every way (a ring wrapping, pages, evictions, a growing concat
cache, rewinds), and the changes hold a small part of what whole packed views would."""

from __future__ import annotations

import copy

import pytest

import kvexplore
from kvexplore.caches.slots import PackedSlots
from kvexplore.trace.packed import KEYFRAME, RecentTraces, SlotChanges, unpacked

STEPS = 150  # past two keyframes


@pytest.mark.parametrize("kind, options", [("preallocated", {}), ("concat", {}), ("paged", {"block_size": 8}),
                                           ("sink", {"sinks": 4, "window": 24}),
                                           ("evict", {"press": "knorm", "compression_ratio": 0.5})])
def test_packed_changes_read_back_as_the_views_each_step_recorded(tiny, kind, options):
    gen = kvexplore.Generator(tiny, kvexplore.make_cache(kind, tiny, max_seq_len=256, **options),
                              tracer=kvexplore.Tracer({"cache"}))
    gen.prefill("Call me Ishmael. Some years ago, never mind how long precisely")
    for i in range(STEPS):
        gen.step()
        if i % 37 == 36 and kind not in ("sink", "evict"):
            gen.rewind(5)  # slots turn stale, and the next steps write them again
    traces = [r.trace for r in gen.history]
    expected = [[copy.deepcopy(v) for v in t.layer_slots] for t in traces]
    recent = RecentTraces(keep=0)
    for t in traces:
        recent.push(t)
    kinds = {type(v) for t in traces for v in t.layer_slots}
    assert SlotChanges in kinds and PackedSlots in kinds  # changes, and a whole view at each keyframe
    depths = [v.depth for t in traces for v in t.layer_slots if isinstance(v, SlotChanges)]
    assert max(depths) < KEYFRAME
    for t, views in zip(traces, expected):
        assert [unpacked(v) for v in t.layer_slots] == views
    changes = sum(v.nbytes for t in traces for v in {id(v): v for v in t.layer_slots}.values())
    whole = sum(PackedSlots.pack(v).nbytes for views in expected for v in {id(v): v for v in views}.values())
    assert changes < whole / 4, (changes, whole)
