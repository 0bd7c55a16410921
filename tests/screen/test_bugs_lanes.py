"""A zoo bug in the explorer: ``bug:NAME`` beside ``bug:NAME:fixed`` (its twin first, the reference), the planted lane
following the twin's tokens; the session finds where they part (the zoo's own first divergence), the token strip
marks that token and the cache map rings the position of its pass in every layer that holds it."""

from __future__ import annotations

import pytest

import kvexplore
import kvexplore.bugs as bugs
from kvexplore.errors import SettingsError
from kvexplore.views import cache_map

BUG = "length-counted-early"


@pytest.fixture(scope="module")
def explorer():
    ex = kvexplore.Explorer("tiny", strategies=(f"bug:{BUG}:fixed", f"bug:{BUG}"), max_seq_len=64)
    ex.prefill(bugs.decoding.TEXT)
    ex.run(6)
    return ex


def test_the_planted_lane_parts_from_its_twin_where_the_zoo_says(explorer):
    d = bugs.reproduce(BUG).first_divergence
    planted, fixed = explorer.session.lanes[f"bug:{BUG}"], explorer.session.lanes[f"bug:{BUG}:fixed"]
    assert planted.divergence == (d.index, d.position) and fixed.divergence is None
    assert type(planted.generator.cache).__module__ == "kvexplore.bugs.decoding"
    assert type(fixed.generator.cache) is kvexplore.PreallocatedCache
    assert planted.generator.tokens == fixed.generator.tokens  # it follows the twin's tokens


def test_the_strip_marks_the_token_and_the_cache_map_rings_the_position(explorer):
    planted = explorer.session.lanes[f"bug:{BUG}"]
    step, position = planted.divergence
    # a changed token is a divergence (red); the same token from a distribution apart a drift (amber), named so
    drift = planted.top1_at[step] is True
    cls, said = ("kvx-drift", "first drift from") if drift else ("kvx-diverge", "first divergence from")
    strip = explorer.token_strip.html(explorer.model.tokenizer, planted.generator, explorer.divergence_mark(planted))
    assert strip.count(f'{cls}"') == 1  # one token's class (the style sheet names it too)
    marked = strip.split(f'{cls}"', 1)[1]
    assert f"step {step} (decode) · position {position + 1}" in marked.split("</span>", 1)[0]
    assert said in marked.split("</span>", 1)[0]
    assert ("chose the same token" in marked.split("</span>", 1)[0]) == drift
    fixed = explorer.session.lanes[f"bug:{BUG}:fixed"]
    fixed_strip = explorer.token_strip.html(explorer.model.tokenizer, fixed.generator, explorer.divergence_mark(fixed))
    assert 'kvx-diverge"' not in fixed_strip and 'kvx-drift"' not in fixed_strip
    snap = explorer.snapshot()
    spec = cache_map.from_snapshot(snap, f"bug:{BUG}")
    rings = next(t for t in spec.traces if t["name"] == "first divergence")
    assert rings["y"] == list(range(explorer.model.config.num_layers))  # every layer holds position `position`
    assert set(rings["x"]) == {float(position)}  # a pre-allocated cache: slot p holds position p
    assert f"{said} bug:{BUG}:fixed at step {step}: " in spec.layout["title"]["text"]  # one short line
    twin = cache_map.from_snapshot(snap, f"bug:{BUG}:fixed")
    assert not [t for t in twin.traces if t["name"] == "first divergence"]


def test_bug_lanes_are_refused_with_the_names_there_are():
    with pytest.raises(SettingsError, match="no bug named 'nope'.*rope-position-zero"):
        kvexplore.Explorer("tiny", strategies=("preallocated", "bug:nope"))
    with pytest.raises(SettingsError, match="prefix pool's bug.*kvexplore bugs run hash-forgets-prefix --html"):
        kvexplore.Explorer("tiny", strategies=("preallocated", "bug:hash-forgets-prefix"))
