"""A run's history keeps its older records compact (kvexplore.trace.kept, kept_trace) and gives back the records it
was given: every record read back equals the one appended and is made of ordinary objects (a StepRecord, a
MemoryReport with its tuple of LayerMemory, a StepTrace with lists of CacheEvent and SlotView), on caches whose slots
move in every way (a ring wrapping, pages, evictions, a growing concat cache, rewinds); a kept slot view is its changes
to the step before, a small part of what whole views would hold; and the history reads, cuts and forks as the list
it stands for."""

from __future__ import annotations

import copy
from dataclasses import fields

import pytest

import kvexplore
from kvexplore.caches.memory import LayerMemory, MemoryReport
from kvexplore.caches.slots import SlotView
from kvexplore.trace.files import History
from kvexplore.trace.kept import KEEP_STEPS, KeptRecords
from kvexplore.trace.kept_trace import KEYFRAME, keep_view
from kvexplore.trace.records import Candidate, StepRecord
from kvexplore.trace.tracer import CacheEvent, StepTrace

STEPS = 150  # past two keyframes


def ordinary(r: StepRecord) -> bool:
    """``r`` is made of the record types themselves, no stand-in for a long run."""
    t, m = r.trace, r.memory
    return (type(r) is StepRecord and type(r.top) is list and all(type(c) is Candidate for c in r.top)
            and (m is None or type(m) is MemoryReport and type(m.layers) is tuple
                 and all(type(x) is LayerMemory for x in m.layers))
            and (t is None or type(t) is StepTrace and type(t.events) is list
                 and all(type(e) is CacheEvent for e in t.events)
                 and type(t.layer_slots) is list and all(type(v) is SlotView for v in t.layer_slots)))


@pytest.mark.parametrize("kind, options", [("preallocated", {}), ("concat", {}), ("paged", {"block_size": 8}),
                                           ("sink", {"sinks": 4, "window": 24}),
                                           ("evict", {"press": "knorm", "compression_ratio": 0.5})])
def test_kept_slot_views_read_back_as_the_views_each_step_recorded(tiny, kind, options):
    gen = kvexplore.Generator(tiny, kvexplore.make_cache(kind, tiny, max_seq_len=256, **options),
                              tracer=kvexplore.Tracer({"cache"}))
    made = [gen.prefill("Call me Ishmael. Some years ago, never mind how long precisely")]
    for i in range(STEPS):
        made.append(gen.step())
        if i % 37 == 36 and kind not in ("sink", "evict"):
            gen.rewind(5)  # slots turn stale, and the next steps write them again
            del made[-5:]
    expected = [[copy.deepcopy(v) for v in r.trace.layer_slots] for r in made]
    reads = [copy.deepcopy(r.trace.layer_reads) for r in made]  # lists of ints (an evicting cache's are scattered)
    # what the generator's history gives back: the views, read positions and events each step recorded
    assert len(gen.history) == len(made)
    for r, views, read, step in zip(gen.history, expected, reads, made):
        assert ordinary(r) and r.trace.layer_slots == views and r.trace.events == step.trace.events
        assert r.trace.layer_reads == read
        assert all(type(p) is int for positions in r.trace.layer_reads for p in positions)
    # the compact form, every record kept (no newest few as they are)
    kept = KeptRecords()
    for r in made:
        kept.append(r)
    views = [v for s in kept.steps for v in s.trace.views]
    assert any(v.base is not None for v in views) and any(v.base is None for v in views)  # changes, and keyframes
    assert max(v.depth for v in views) < KEYFRAME
    for i, want in enumerate(expected):
        assert kept.record(i).trace.layer_slots == want
    changes = sum(v.nbytes for v in views)
    whole = sum(keep_view(v).nbytes for views in expected for v in {id(v): v for v in views}.values())
    assert changes < whole / 4, (changes, whole)


def test_older_records_are_kept_compact_and_read_back_the_same(tiny, tmp_path):
    """Past KEEP_STEPS records, a record is kept compact: its memory report's layers as one row of figures each, its
    trace's cache events as one array and its attention entries as one (first, end) pair when every layer's are one
    step's; read back, each is the record the step made, of ordinary objects, and a saved run loads the same."""
    from kvexplore.explorer.session import Session

    s = Session(tiny, ("preallocated", "paged"), max_seq_len=200)
    s.prefill("Call me Ishmael. Some years ago, never mind how long precisely")
    made = {name: [lane.history[0]] for name, lane in s.lanes.items()}
    seen = {}
    for _ in range(KEEP_STEPS + 20):
        s.step()
        for name, lane in s.lanes.items():
            r = lane.history[-1]
            made[name].append(r)
            seen[name, r.step] = (tuple(r.memory.layers), r.memory.by_kind(), list(r.trace.events),
                                  r.trace.attention_layers, list(r.top), dict(r.memory.held),
                                  [v.layout for v in r.trace.layer_slots])
    for name, lane in s.lanes.items():
        old = [r for r in lane.history[:-KEEP_STEPS] if r.step > 0]
        assert len(old) >= 19
        for r in old:
            layers, kinds, events, attention, top, held, layouts = seen[name, r.step]
            assert ordinary(r) and r == made[name][r.step] and r is not made[name][r.step]  # rebuilt, equal
            assert r.memory.layers == layers and r.memory.by_kind() == kinds
            assert r.trace.events == events and r.trace.attention_layers == attention
            assert r.top == top and r.top[0] == top[0] and r.top[-1] == top[-1] and r.top[1:3] == top[1:3]
            assert r.memory.held == held and [v.layout for v in r.trace.layer_slots] == layouts
        assert all(a is b for a, b in zip(lane.history[-KEEP_STEPS:], made[name][-KEEP_STEPS:]))  # as appended
        assert lane.history[3] is lane.history[3]  # asked again: the same object
        # what did not change is held once: the report's dicts of figures, a page table between new blocks, and a
        # token's text (interned: every record that chose or listed it holds the same string)
        assert len({id(r.memory.held) for r in old}) < len(old) / 2
        layouts = {id(r.trace.layer_slots[0].layout) for r in old} if name == "paged" else set()
        assert name != "paged" or len(layouts) < len(old) / 2
        texts = {}
        for r in lane.history:
            for c in r.top:
                assert texts.setdefault(c.text, c.text) is c.text
        kept = KeptRecords()
        for r in made[name]:
            kept.append(r)
        steps = kept.steps[1:]  # (the prefill's differs)
        assert len({id(k.memory.kinds) for k in steps}) == 1  # the layers' kinds kept once for the run
        assert all(isinstance(k.trace.attention, tuple) for k in steps)  # one (layers, first, end) each
        assert len({id(k.trace.attention[0]) for k in steps}) == 1

    gen = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=128),
                              tracer=kvexplore.Tracer({"cache", "memory"}))
    first = gen.prefill("Call me Ishmael.")
    gen.run(KEEP_STEPS + 5, stop_at_eos=False)
    assert gen.history[0] == first and gen.history[0] is not first  # any generator's history keeps them compact
    back = kvexplore.load_trace(gen.history.save(tmp_path / "run"))
    assert [tuple(r.memory.layers) for r in back] == [tuple(r.memory.layers) for r in gen.history]
    assert [list(r.top) for r in back] == [list(r.top) for r in gen.history]


def test_a_kept_record_keeps_every_field(tiny):
    """Every field of a record is kept: a new field of StepRecord, MemoryReport or LayerMemory must be kept too."""
    layer = LayerMemory(layer=1, kind="sliding", held=7, logical_bytes=2 ** 40, reserved_bytes=5, analytic_bytes=6,
                        written_bytes=8, copied_bytes=9, held_bytes=10, parts={"keys and values": 10})
    memory = MemoryReport(length=7, logical_bytes=1, reserved_bytes=2, analytic_bytes=3, written_bytes=4,
                          copied_bytes=5, allocated_bytes=6, freed_bytes=7, allocations=8, frees=9,
                          cuda={"allocations": 1}, cuda_now={"allocated_bytes": 2}, layers=(layer,), held_bytes=11,
                          held={"keys and values": 10, "undo scratch": 1}, step_bytes=12)
    record = StepRecord(step=3, kind="decode", token_id=42, text=" whale", position=19, input_len=4,
                        cache_length=20, prob=0.123456789, top=[Candidate(42, " whale", 0.123456789)],
                        forward_s=1e-3, sample_s=2e-4, is_eos=True, memory=memory, trace=None, draft_token=17,
                        verification=2)
    assert {f.name for f in fields(StepRecord)} == {"step", "kind", "token_id", "text", "position", "input_len",
                                                     "cache_length", "prob", "top", "forward_s", "sample_s", "is_eos",
                                                     "memory", "trace", "draft_token", "verification"}
    for f in (*fields(MemoryReport), *fields(LayerMemory)):  # every figure set above differs from its default
        obj = memory if f in fields(MemoryReport) else layer
        assert getattr(obj, f.name) != f.default, f.name
    kept = KeptRecords()
    kept.append(record)
    kept.append(StepRecord(4, "decode", 1, "a", 20, 1, 21, 0.5))  # no memory, no candidates, no drafts
    assert kept.record(0) == record and ordinary(kept.record(0))
    assert kept.record(1) == StepRecord(4, "decode", 1, "a", 20, 1, 21, 0.5)


def test_a_history_reads_cuts_and_forks_as_a_list(tiny):
    gen = kvexplore.Generator(tiny, kvexplore.make_cache("preallocated", tiny, max_seq_len=128),
                              tracer=kvexplore.Tracer({"cache"}))
    made = [gen.prefill("Call me Ishmael.")]
    made += [gen.step() for _ in range(3 * KEEP_STEPS)]
    h = gen.history
    assert isinstance(h, History) and len(h) == len(made) and h == made and made == h and list(h) == made
    assert h[-1] is made[-1] and h[-len(made)] == made[0] and h[2:5] == made[2:5] and h[::7] == made[::7]
    assert list(reversed(h)) == made[::-1] and made[4] in h and h.index(made[4]) == 4
    with pytest.raises(IndexError):
        h[len(made)]
    twin = History(h)  # a fork's: the same records, its own from now on
    gen.rewind(KEEP_STEPS + 3)  # past the newest records, into the kept ones
    assert h == made[:-(KEEP_STEPS + 3)] and twin == made
    again = [gen.step() for _ in range(KEEP_STEPS + 5)]
    assert h == made[:-(KEEP_STEPS + 3)] + again and twin == made
    assert [r.step for r in h] == list(range(len(h)))
    del twin[2]  # anywhere, as a list does
    assert twin == made[:2] + made[3:]
    twin.insert(2, made[2])
    twin[0] = made[0]
    assert twin == made and twin.pop() == made[-1] and len(twin) == len(made) - 1
    shared = StepTrace()  # the records of a verification share one trace: kept once, read back as one
    rs = History([StepRecord(i, "decode", i, "x", i, 3, i, 0.5, trace=shared) for i in range(3)] +
                 [StepRecord(3 + i, "decode", 0, "y", 3 + i, 1, 3 + i, 0.5) for i in range(KEEP_STEPS)])
    assert rs[0].trace is rs[1].trace is rs[2].trace and rs[0].trace == shared
