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


def test_older_records_keep_their_events_memory_and_attention_entries_packed_and_read_the_same(tiny, tmp_path):
    """Past KEEP_STEPS records, a record's memory report keeps its layers as one row of figures each (PackedLayers),
    its trace its cache events as one array (PackedEvents) and its attention entries as one (first, end) pair when
    every layer's are one step's: each reads back equal to what the step recorded, and a saved run loads the same."""
    from kvexplore.caches.memory import PackedLayers
    from kvexplore.explorer.session import Session
    from kvexplore.trace.records import PackedCandidates
    from kvexplore.trace.packed import KEEP_STEPS, PackedEvents, SameRows

    s = Session(tiny, ("preallocated", "paged"), max_seq_len=200)
    s.prefill("Call me Ishmael. Some years ago, never mind how long precisely")
    seen = {}
    for _ in range(KEEP_STEPS + 20):
        s.step()
        for name, lane in s.lanes.items():
            r = lane.history[-1]
            seen[name, r.step] = (tuple(r.memory.layers), r.memory.by_kind(), list(r.trace.events),
                                  r.trace.attention_layers, list(r.top), dict(r.memory.held),
                                  [unpacked(v).layout for v in r.trace.layer_slots])
    for name, lane in s.lanes.items():
        old = [r for r in lane.history[:-KEEP_STEPS] if r.step > 0]
        assert len(old) >= 19
        for r in old:
            layers, kinds, events, attention, top, held, layouts = seen[name, r.step]
            assert isinstance(r.memory.layers, PackedLayers) and r.memory.layers == layers
            assert tuple(r.memory.layers) == layers and r.memory.by_kind() == kinds
            assert isinstance(r.trace.events, PackedEvents) and list(r.trace.events) == events
            assert isinstance(r.trace._attention, SameRows) and r.trace.attention_layers == attention
            assert isinstance(r.top, PackedCandidates) and r.top == top and list(r.top) == top
            assert r.top[0] == top[0] and r.top[-1] == top[-1] and r.top[1:3] == top[1:3] and len(r.top) == len(top)
            assert r.memory.held == held and [unpacked(v).layout for v in r.trace.layer_slots] == layouts
        assert all(not isinstance(r.memory.layers, PackedLayers) for r in lane.history[-KEEP_STEPS:])
        assert all(isinstance(r.top, list) for r in lane.history[-KEEP_STEPS:])
        # what did not change is held once: the report's dicts of figures, a page table between new blocks, and a
        # token's text (interned: every record that chose or listed it holds the same string)
        assert len({id(r.memory.held) for r in old}) < len(old) / 2
        layouts = {id(unpacked(r.trace.layer_slots[0]).layout) for r in old} if name == "paged" else set()
        assert name != "paged" or len(layouts) < len(old) / 2
        texts = {}
        for r in lane.history:
            for c in r.top:
                assert texts.setdefault(c.text, c.text) is c.text
        shared = {id(r.memory.layers.kinds) for r in old}
        assert len(shared) == 1  # the layers' kinds kept once for the run

    gen = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=128),
                              tracer=kvexplore.Tracer({"cache", "memory"}))
    gen.prefill("Call me Ishmael.")
    gen.run(KEEP_STEPS + 5, stop_at_eos=False)
    assert isinstance(gen.history[1].memory.layers, PackedLayers)
    back = kvexplore.load_trace(gen.history.save(tmp_path / "run"))
    assert [tuple(r.memory.layers) for r in back] == [tuple(r.memory.layers) for r in gen.history]
    assert [list(r.top) for r in back] == [list(r.top) for r in gen.history]
