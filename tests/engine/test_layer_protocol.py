"""What one layer says of itself through the narrow layer protocol (docs/extending.md, "The layer protocol"): going back
is one question, ``take_back(n, length)``, and which positions it holds and reads is one, ``positions(length)``; both
agree with what the container and the inspector do with them."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.caches.layer import Positions, TakeBack

WINDOW = 4


@pytest.fixture
def windowed(zoo):
    """Gemma 3's plan (sliding layers with a ring of 4 slots, full layers) on random weights, 10 positions written."""
    model = zoo.load("gemma3", layers=6, sliding_window=WINDOW)
    cache = kvexplore.make_cache("preallocated", model, max_seq_len=16)
    model(torch.arange(10)[None], cache, 0)
    return model, cache


def _kinds(cache):
    ring = next(i for i, s in enumerate(cache.plan) if s.ring)
    return cache.layers[ring], cache.layers[cache.full_layers[0]]


def test_take_back_answers_each_way_of_going_back(windowed):
    _, cache = windowed
    ring, full = _kinds(cache)
    back = ring.take_back(8, 10)
    assert isinstance(back, TakeBack) and back.truncate is None
    assert back.replay and back.replay == cache.inspect.replay_error(8)  # the ring wrapped over positions 4 and 5
    assert back.crop == back.replay and "rolled back" in back.way
    assert full.take_back(8, 10) == (None, None, None, full.take_back(0, 10).way)
    assert cache.inspect.crop_ways()[type(ring).__name__] == back.way
    assert ring.take_back(10, 10).replay is None  # nothing to give back
    with pytest.raises(kvexplore.SettingsError, match="cannot truncate to 8"):
        cache.truncate(8)
    assert cache.length == 10  # refused before any layer moved


def test_positions_are_what_the_inspector_reports(windowed):
    _, cache = windowed
    ring, full = _kinds(cache)
    at = ring.positions(cache.length)
    assert isinstance(at, Positions)
    assert at.held == [6, 7, 8, 9] and at.count == WINDOW  # the ring's window, oldest first
    assert sorted(at.slots().positions) == at.held  # its slots hold them, in storage order
    assert full.positions(10).held == full.positions(10).read == list(range(10)) and full.positions(10).count == 10
    i = cache.layers.index(ring)
    assert cache.inspect.held_positions_of(i) == at.held and cache.inspect.layer_held(i) == at.count
    assert cache.inspect.slot_view(i) == at.slots()
    assert full.memory(10).held == 10 and ring.memory(10).held == WINDOW  # the memory report counts the same


def test_a_fork_shares_the_paged_pool_and_a_clone_does_not(zoo):
    model = zoo.load("gemma3", layers=6, sliding_window=WINDOW)
    cache = kvexplore.make_cache("paged", model, max_seq_len=32, block_size=4)
    model(torch.arange(10)[None], cache, 0)
    layer = cache.layers[cache.full_layers[0]]
    assert layer.clone({}, fork=True).table.pool is layer.table.pool
    assert layer.clone({}).table.pool is not layer.table.pool
