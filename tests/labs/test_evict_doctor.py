"""The cache doctor on pressed (evict) caches: a recomputation with the same kept set, in both position modes and both
storages, clean on the real thing and pointing at the rotation when one is planted wrong."""

from __future__ import annotations

import pytest

import kvexplore
from kvexplore.caches.layers.pressed import PressedLayer

PROMPT = "Once upon a time there was a little girl named Lily who loved to play outside"


@pytest.mark.sampled
@pytest.mark.parametrize("storage", ["compact", "mask"])
@pytest.mark.parametrize("positions", ["keep", "rerotate"])
@pytest.mark.parametrize("press, options", [("knorm", {}), ("snapkv", {"heads": "adaptive"}),
                                            ("h2o", {"decode_every": 4})])
def test_the_doctor_finds_nothing_on_a_press_lane(trained, storage, positions, press, options):
    cache = kvexplore.make_cache("evict", trained, max_seq_len=64, press=press, storage=storage, positions=positions,
                                 press_options={"window": 4} if press == "snapkv" else None, **options)
    report = kvexplore.doctor(trained, prompt=PROMPT, steps=12, cache=cache)
    assert not report.diverged, report.summary()
    assert cache.eviction.press_events[0].reason == "prompt" and cache.length == len(report.tokens) - 1
    assert report.worst.relative < 1e-4 and "matches a recomputation with the same kept set" in report.summary()


def test_the_reference_keeps_what_the_cache_kept_not_everything(trained):
    """Against a full recomputation a press lane departs (it dropped keys); against its kept set it does not."""
    cache = kvexplore.make_cache("evict", trained, max_seq_len=64, press="knorm", compression_ratio=0.75)
    report = kvexplore.doctor(trained, prompt=PROMPT, steps=6, cache=cache)
    assert not report.diverged
    kept = cache.eviction.kept_positions(0)
    assert all(len(h) < cache.length for h in kept)  # something was evicted, so the reference really was restricted


@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_a_key_turned_by_the_wrong_amount_is_named(trained, monkeypatch, storage):
    turn = PressedLayer.turn
    monkeypatch.setattr(PressedLayer, "turn", lambda self, k, old, new: turn(self, k, old, new + 2))
    cache = kvexplore.make_cache("evict", trained, max_seq_len=64, press="knorm", positions="rerotate",
                                 storage=storage)
    report = kvexplore.doctor(trained, prompt=PROMPT, steps=4, cache=cache)
    assert report.diverged and report.what == "keys" and report.layer == 0
    assert "positions and rotations disagree" in report.hint and "turned +2 positions" in report.hint
    assert "re-rotated by the wrong amount" in report.hint


def test_keys_re_rotated_in_a_cache_that_says_it_keeps_positions_are_named(trained):
    cache = kvexplore.make_cache("evict", trained, max_seq_len=64, press="knorm", positions="keep")
    cache.pressplan.rerotate = True  # the storage turns the kept keys; the cache still says positions="keep"
    report = kvexplore.doctor(trained, prompt=PROMPT, steps=4, cache=cache)
    assert report.diverged and report.what == "keys"
    assert "positions and rotations disagree" in report.hint
    assert "when it should keep its position" in report.hint


@pytest.mark.sampled
@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "qwen3_next", "gemma4"])
@pytest.mark.parametrize("positions", ["keep", "rerotate"])
def test_the_doctor_checks_press_lanes_beside_rings_states_sinks_and_shared_layers(zoo, arch, positions):
    """Sliding layers keep their rings, recurrent layers their state, shared layers read a pressed source; the
    reference keeps the same kept sets in the pressed layers and recomputes the rest."""
    model = zoo.load(arch, layers=3) if arch in ("gemma3", "gpt_oss") else zoo.load(arch)  # a full layer or more
    cache = kvexplore.make_cache("evict", model, max_seq_len=64, press="snapkv", positions=positions,
                                 press_options={"window": 4}, decode_every=5)
    report = kvexplore.doctor(model, prompt=list(range(3, 40)), steps=12, cache=cache)
    assert not report.diverged, report.summary()
    assert cache.eviction.press_events
    assert all(len(h) < cache.length for h in cache.eviction.kept_positions(cache.full_layers[0]))
