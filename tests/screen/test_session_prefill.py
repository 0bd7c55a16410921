"""A new prompt in the explorer: the old lanes are let go before the new ones are built (the peak holds one set of
lane caches, not two), a bad prompt changes nothing, and a failure after the checks leaves every lane empty."""

from __future__ import annotations

import weakref

import pytest

import kvexplore

STRATEGIES = ("preallocated", "paged", "sink", "evict")


def explorer(trained):
    ex = kvexplore.Explorer(trained, strategies=STRATEGIES, max_seq_len=64, prompt="Call me Ishmael.")
    ex.step()
    ex.session.fork()
    return ex


def test_the_old_lanes_caches_are_gone_before_the_first_new_lane_is_built(trained, monkeypatch):
    ex = explorer(trained)
    session = ex.session
    old = [weakref.ref(lane.cache) for lane in session.lanes.values()]
    assert len(old) == len(STRATEGIES) + 1  # the fork's too
    alive_at_build = []
    build = session._new_lane

    def spy(*args, **kw):
        alive_at_build.append(sum(r() is not None for r in old))
        return build(*args, **kw)

    monkeypatch.setattr(session, "_new_lane", spy)
    ex.prefill("Some years ago, never mind how long precisely")
    assert alive_at_build == [0] * len(STRATEGIES)  # none of the old caches while any new one is built
    assert list(session.lanes) == list(STRATEGIES) and all(lane.generator.tokens == session.tokens
                                                            for lane in session.lanes.values())


def test_the_old_lanes_go_by_reference_counting_without_a_full_collection(trained, monkeypatch):
    """No lane holds a cycle, so a new prompt frees the old caches as their lanes go: the prefill runs no full
    garbage collection (which walks every object of the process: a few tenths of a second in a kernel), and it
    runs one where a cache outlived its lanes."""
    from kvexplore.explorer import session as session_module

    collections = []
    monkeypatch.setattr(session_module.gc, "collect", lambda *a: collections.append(a) or 0)
    ex = kvexplore.Explorer(trained, strategies=("preallocated", "concat", "paged", "sink", "evict", "quantized"),
                            max_seq_len=64, prompt="Call me Ishmael.")
    ex.run(3)
    ex.session.fork()
    ex.prefill("Some years ago, never mind how long precisely")
    assert collections == []
    kept = ex.session.lanes["paged"].cache  # a cache someone still holds: collected for, in case a cycle holds it
    ex.prefill("Call me Ishmael.")
    assert len(collections) == 1 and kept.length > 0


def test_a_bad_prompt_changes_nothing_and_a_later_failure_leaves_every_lane_empty(trained, monkeypatch):
    ex = explorer(trained)
    session = ex.session
    lanes, tokens = dict(session.lanes), list(session.tokens)
    with pytest.raises(kvexplore.SettingsError):
        ex.session.prefill([1, 10 ** 7])  # an id outside the vocabulary: refused before any lane is touched
    assert session.lanes == lanes and session.tokens == tokens
    calls = []
    prefill = kvexplore.Generator.prefill

    def failing(self, *args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise MemoryError("no room for the second lane")
        return prefill(self, *args, **kw)

    monkeypatch.setattr(kvexplore.Generator, "prefill", failing)
    with pytest.raises(MemoryError):
        session.prefill("Some years ago")
    assert list(session.lanes) == list(STRATEGIES)
    assert all(not lane.generator.tokens and lane.cache.length == 0 for lane in session.lanes.values())
    with pytest.raises(kvexplore.StateError, match="prefill first"):
        session.step()
    monkeypatch.setattr(kvexplore.Generator, "prefill", prefill)
    session.prefill("Some years ago")
    session.step()
    assert len({tuple(lane.generator.tokens) for lane in session.lanes.values() if lane.follows}) == 1
