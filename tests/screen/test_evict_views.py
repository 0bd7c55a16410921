"""The eviction views draw what the evict cache holds: the press scores and kept masks
(``cache.eviction.press_scores``),
the positions each head holds (``cache.eviction.kept_mask``, ``kept_positions``), the held counts over the steps and the
bytes (memory reports against ``kv_bytes``), in the explorer, in the replay's frames, and binned at 2,000+ tokens."""

from __future__ import annotations

import base64
import gzip
import json
import re

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")
pytest.importorskip("ipywidgets")

import kvexplore  # noqa: E402
from kvexplore.caches.memory import kv_bytes  # noqa: E402
from kvexplore.errors import SettingsError  # noqa: E402
from kvexplore.replay import frames  # noqa: E402
from kvexplore.views import eviction, press  # noqa: E402
from kvexplore.views.registry import TABS, VIEWS  # noqa: E402
from kvexplore.views.spec import figure  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 2
EVICT = {"press": "knorm", "compression_ratio": 0.5, "decode_every": 3}
STEPS = 7


@pytest.fixture(scope="module")
def ex(trained):
    """Three lanes on one prompt: the full cache, the compacting evict cache and its masking twin; after each step
    the positions each evict head holds, as the cache says."""
    ex = kvexplore.Explorer(trained, strategies=["preallocated", "evict", "evict@mask"], max_seq_len=128,
                            strategy_options={"evict": EVICT, "evict@mask": {**EVICT, "storage": "mask"}})
    ex.prefill(PROMPT)
    ex.held = [_held(ex.lanes["evict"].cache)]
    for _ in range(STEPS):
        ex.step()
        ex.held.append(_held(ex.lanes["evict"].cache))
    ex.controls["lane"].value = "evict"
    return ex


def _held(cache) -> dict[int, list[int]]:
    return {layer: [len(p) for p in cache.eviction.kept_positions(layer)] for layer in cache.full_layers}


def _grid(trace, rows: int, cols: int, key: str = "z") -> np.ndarray:
    """A heatmap given as columns, back as a (rows, cols) matrix indexed by (y, x); NaN where no cell was sent."""
    out = np.full((rows, cols), np.nan)
    x = np.asarray(trace["x"]).astype(int)
    out[np.asarray(trace["y"]).astype(int), x] = np.asarray(trace[key], dtype=float)
    return out


def test_the_views_are_registered_tabs_replayed_per_lane_and_per_run():
    assert {"press", "kept", "eviction"} <= set(TABS)
    assert (VIEWS["press"].replay, VIEWS["kept"].replay, VIEWS["eviction"].replay) == ("lane", "lane", "run")


@pytest.mark.parametrize("layer", [0, 3])
def test_press_scores_equal_the_caches_last_press(ex, layer):
    ex.layer = layer
    spec = ex.specs(["press"])["press"]
    figure(spec)  # plotly accepts every property
    cache = ex.lanes["evict"].cache
    scores, kept = (t.numpy() for t in cache.eviction.press_scores(layer))
    heat = spec.trace("scores")
    got = _grid(heat, *scores.shape, key="customdata")
    held = ~np.isnan(scores)
    assert np.array_equal(~np.isnan(got), held & np.isfinite(scores))  # a cell for every position held then
    np.testing.assert_allclose(got[held], scores[held], rtol=1e-6)
    z = _grid(heat, *scores.shape)
    assert np.array_equal(z[held] >= 1, kept[held])  # kept: z in 1..2, evicted: 0..1
    assert f"press at {cache.eviction.press_events[-1].length}<br>" in spec.layout["title"]["text"]
    assert spec.layout["title"]["text"].startswith("knorm scores · evict · layer")
    h, p = int(heat["y"][0]), int(heat["x"][0])
    assert heat["text"][0].startswith(f"KV head {h} · position {p} ")
    assert ("kept" if kept[h, p] else "evicted") in heat["text"][0]
    ex.layer = 0


def test_kept_map_equals_the_caches_kept_mask_per_layer_and_head(ex):
    spec = ex.specs(["kept"])["kept"]
    figure(spec)
    cache = ex.lanes["evict"].cache
    want = np.concatenate([cache.eviction.kept_mask(layer).numpy() for layer in cache.full_layers]).astype(float)
    assert np.array_equal(_grid(spec.trace("kept mask"), *want.shape), want)
    ticks = spec.layout["yaxis"]["ticktext"]
    assert ticks[:3] == ["L0 h0", "L0 h1", "L1 h0"]
    # the record's mask is the cache's at every layer (derived from the last press and the positions since)
    rec = ex.lane.last.trace.press
    for layer in cache.full_layers:
        assert np.array_equal(rec.kept_mask(layer), cache.eviction.kept_mask(layer).numpy())


def test_held_per_head_and_bytes_over_the_steps_equal_the_caches(ex):
    spec = ex.specs(["eviction"])["eviction"]
    figure(spec)
    for layer in (0, 2):
        lines = eviction.spec(ex.session.runs(), layer)
        for h in range(2):
            assert lines.trace(f"held · head {h} · evict").get("y") == [held[layer][h] for held in ex.held]
    assert spec.trace("held · head 0 · evict")["x"] == list(range(STEPS + 1))
    drops = np.diff(spec.trace("held · head 0 · evict")["y"])
    assert (drops < 0).any() and (drops > 0).any()  # the sawtooth of presses during decoding
    for name in ("preallocated", "evict", "evict@mask"):
        lane = ex.lanes[name]
        report = lane.cache.inspect.memory_report()
        assert spec.trace(f"reserved · {name}")["y"][-1] == report.reserved_bytes
        assert spec.trace(f"used · {name}")["y"][-1] == report.logical_bytes
    cache = ex.lanes["evict"].cache
    assert spec.trace("full cache")["y"][-1] == kv_bytes(cache.config, cache.length) == \
        ex.lanes["preallocated"].cache.inspect.memory_report().logical_bytes
    assert spec.trace("sequence length")["y"][-1] == cache.length
    # the compacting storage holds what it keeps (each head's count x key and value width); the mask keeps it all
    c = cache.config
    kept = sum(len(p) for layer in cache.full_layers for p in cache.eviction.kept_positions(layer))
    assert spec.trace("used · evict")["y"][-1] == kept * 2 * c.head_dim * 4
    assert spec.trace("used · evict@mask")["y"][-1] == spec.trace("used · evict")["y"][-1]
    full = ex.lanes["preallocated"].cache.inspect.memory_report().reserved_bytes
    assert spec.trace("reserved · evict@mask")["y"][-1] == full
    assert spec.trace("reserved · evict")["y"][-1] < spec.trace("full cache")["y"][-1]


def test_a_lane_that_does_not_press_says_so(ex):
    ex.controls["lane"].value = "preallocated"
    try:
        specs = ex.specs(["press", "kept"])
        for spec in specs.values():
            assert not spec.traces and "does not press" in spec.layout["annotations"][0]["text"]
    finally:
        ex.controls["lane"].value = "evict"


def test_the_replay_frames_draw_the_same_figures(ex):
    out, store = frames(ex.session.runs())
    last = out[-1]["figures"]
    assert {"press:evict", "kept:evict", "press:evict@mask", "eviction"} <= set(last)
    live = ex.specs(["press"])["press"]
    trace = last["press:evict"]["data"][0]
    decode = lambda v: np.frombuffer(base64.b64decode(store.arrays[v["$a"]]["b64"]),  # noqa: E731
                                     dtype=store.arrays[v["$a"]]["dtype"])[: v["n"]]
    np.testing.assert_array_equal(decode(trace["z"]), np.asarray(live.trace("scores")["z"]))
    # the first step's frame shows the prompt's press (the records keep each press's outcome)
    first = out[0]["figures"]["press:evict"]["layout"]["title"]["text"]
    assert "prompt press" in first
    assert "press:preallocated" not in last  # a lane that does not press has no press figures in a replay
    # the notebook's static copy embeds the same replay
    packed = re.findall(r'class="kvx-data">([^<]+)</script>', ex._static.html())[0]
    meta = json.loads(gzip.decompress(base64.b64decode(packed)))["meta"]
    assert meta["views"] == {"lane": ["cache_map", "attention", "press", "kept"], "run": ["memory", "eviction"]}


def test_variant_lanes_run_one_strategy_twice_and_bad_names_are_refused(ex, trained):
    assert ex.lanes["evict@mask"].cache.storage_kind == "mask" and ex.lanes["evict"].cache.storage_kind == "compact"
    for bad in ("evict@", "nothing@mask"):
        with pytest.raises(SettingsError, match="unknown strategy"):
            kvexplore.Explorer(trained, strategies=["preallocated", bad])


def test_at_2000_tokens_the_views_are_binned_to_the_screen(trained):
    cache = kvexplore.make_cache("evict", trained, max_seq_len=2200, **EVICT)
    g = kvexplore.Generator(trained, cache, tracer=kvexplore.Tracer())
    g.prefill([5 + i % 200 for i in range(2100)])
    for _ in range(4):
        g.step()
    record = g.history[-1]
    spec = press.scores_spec(record, "evict", 0)
    figure(spec)
    scores, kept = (t.numpy() for t in cache.eviction.press_scores(0))
    heat = spec.trace("scores")
    assert len(set(np.asarray(heat["x"]).tolist())) <= 512 and "bins of 8" in spec.layout["xaxis"]["title"]["text"]
    # a bin's customdata is the highest score of the positions it covers
    x, y = np.asarray(heat["x"]), np.asarray(heat["y"])
    i = len(x) // 2
    first = int(x[i] - 3.5)
    block = scores[y[i], first: first + 8]
    assert heat["customdata"][i] == pytest.approx(np.nanmax(block), rel=1e-6)
    kept_here, held_here = kept[y[i], first: first + 8].sum(), (~np.isnan(block)).sum()
    assert held_here and (heat["z"][i] >= 1) == bool(2 * kept_here >= held_here)  # blue: half of it kept or more
    spec = press.kept_spec(record, "evict")
    mask = cache.eviction.kept_mask(0).numpy()
    held = spec.trace("kept mask")
    j = int(np.argmin(np.abs(np.asarray(held["x"]) - 1027.5)))
    assert int(held["y"][j]) == 0 and held["z"][j] == pytest.approx(mask[0, 1024:1032].mean())
    zoomed = press.kept_spec(record, "evict", zoom={"xaxis": (999.5, 1199.5)})
    cells = zoomed.trace("kept mask")
    assert np.asarray(cells["x"]).min() == 1000 and np.asarray(cells["x"]).max() == 1199  # full resolution
    assert cache.length == 2104


def _evict_run(trained):
    cache = kvexplore.make_cache("evict", trained, max_seq_len=96, **EVICT)
    g = kvexplore.Generator(trained, cache, tracer=kvexplore.Tracer())
    g.prefill(PROMPT)
    g.run(6, stop_at_eos=False)
    return cache, g


def test_a_saved_evict_trace_loads_with_its_slot_views(trained, tmp_path):
    _, g = _evict_run(trained)
    back = kvexplore.load_trace(g.history.save(tmp_path / "run.kvtrace"))
    assert back[-1].trace.slots.positions == g.history[-1].trace.slots.positions


def test_a_saved_trace_keeps_the_press_and_draws_the_same(trained, tmp_path):
    cache, g = _evict_run(trained)
    for r in g.history:  # (slot views left out: see the test above)
        r.trace.layer_slots = []
    back = kvexplore.load_trace(g.history.save(tmp_path / "run.kvtrace"))
    pairs = [(a.trace.press, b.trace.press) for a, b in zip(back, back[1:])]
    assert all((a.last is b.last) == (a.presses == b.presses) for a, b in pairs)  # shared until the next press
    assert any(a.presses == b.presses for a, b in pairs) and any(a.presses != b.presses for a, b in pairs)
    assert back[0].trace.press.last.reason == "prompt"
    assert back[-1].trace.press.presses == len(cache.eviction.press_events)
    for a, b in ((g.history, back),):
        for layer in (0, 5):
            sa, sb = press.scores_spec(a[-1], "evict", layer), press.scores_spec(b[-1], "evict", layer)
            np.testing.assert_array_equal(sa.trace("scores")["customdata"], sb.trace("scores")["customdata"])
            assert sa.layout == sb.layout
        ka, kb = press.kept_spec(a[-1], "evict"), press.kept_spec(b[-1], "evict")
        np.testing.assert_array_equal(ka.trace("kept mask")["z"], kb.trace("kept mask")["z"])
        assert eviction.spec({"evict": a}, 0).traces == eviction.spec({"evict": b}, 0).traces


def test_attention_rows_land_on_each_heads_own_positions(trained):
    """Heads of a pressed layer hold different positions (adaptive budgets): the attention view's rows put each
    query head's probabilities on the positions its KV head read, nowhere else."""
    ex = kvexplore.Explorer(trained, strategies=["evict"], max_seq_len=128,
                            strategy_options={"evict": {"press": "knorm", "heads": "adaptive", "decode_every": 3}})
    ex.prefill(PROMPT)
    ex.run(5)
    cache, store = ex.lanes["evict"].cache, ex.lanes["evict"].tracer.history
    layer, q = 0, cache.length - 1
    kept = cache.eviction.kept_positions(layer)
    assert len({len(h) for h in kept}) > 1  # the heads really hold different counts
    row = store.row(layer, q)  # (query heads, q + 1)
    group = row.shape[0] // len(kept)
    read = cache.eviction.read_positions_by_head(layer)
    for h in range(row.shape[0]):
        held = {p for p in read[h // group] if p >= 0}
        assert abs(row[h].sum() - 1) < 1e-5
        assert set(np.flatnonzero(row[h] > 0)) <= held and max(held) == q
