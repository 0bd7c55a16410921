"""The explorer at long contexts: a bounded attention store per lane (binned overview of every row, the newest rows
at full resolution, rows recomputed on a zoom), a history that keeps older steps compact, and the attention view
drawn from them -- checked against the full attention matrix computed independently (a plain tracer, numpy
binning)."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

import kvexplore
from kvexplore import Generator, Tracer, make_cache
from kvexplore.caches.slots import SlotView
from kvexplore.explorer import attention_store
from kvexplore.explorer.session import Session
from kvexplore.explorer.strip import TokenStrip
from kvexplore.trace.kept import KEEP_STEPS
from kvexplore.trace.kept_trace import keep_view
from kvexplore.views import attention, snapshot
from kvexplore.views.spec import grid


@pytest.fixture
def small_bins(monkeypatch):
    """A store of 16 row bins x 32 key bins and 4 recent rows: a few hundred tokens are binned and merged."""
    monkeypatch.setattr(attention_store, "ROW_BINS", 16)
    monkeypatch.setattr(attention_store, "COL_BINS", 32)
    monkeypatch.setattr(attention_store, "RECENT", 4)


_PREFILLS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {tokens: the prefill's trace}


def full_attention(model, tokens, layer, head):
    """``(T, T)``: every row of ``layer``/``head`` over ``tokens`` by a plain tracer's prefill (the reference). One
    prefill records every layer: it is made once per model and tokens (the strategies' runs reach the same tokens)."""
    traces = _PREFILLS.setdefault(model, {})
    key = tuple(tokens)
    if key not in traces:
        gen = Generator(model, make_cache("preallocated", model, max_seq_len=len(tokens) + 1),
                        tracer=Tracer({"attention"}))
        gen.prefill(list(tokens))
        traces.clear()  # only the latest tokens are asked again
        traces[key] = gen.history[0].trace
    return traces[key].attention(layer)[:, head].numpy()


def binned(full, rs, cs, how):
    """``full`` (NaN past the diagonal: query q reads keys 0..q) reduced to bins of rs x cs with numpy alone."""
    T = full.shape[0]
    R, K = -(-T // rs), -(-T // cs)
    m = np.full((R * rs, K * cs), np.nan)
    m[:T, :T] = np.where(np.tril(np.ones((T, T), bool)), full, np.nan)
    blocks = m.reshape(R, rs, K, cs).transpose(0, 2, 1, 3).reshape(R, K, rs * cs)
    with np.errstate(invalid="ignore"), __import__("warnings").catch_warnings():
        __import__("warnings").simplefilter("ignore", RuntimeWarning)
        return np.nanmax(blocks, -1) if how == "max" else np.nanmean(blocks, -1)


# A recent row decoded one token at a time against the cache and the same row of the reference prefill are the same
# softmax computed in two summation orders (one query against the cache, or all T at once: other matmul blockings
# over the hidden size, the head dimension and the keys), so they agree to float32 rounding, not bit for bit. Each
# probability is exp(s_i - m) / Z: the normalizer Z sums n <= T positive terms, which float32 does to within a
# relative (n - 1) * eps in any order, and the logits s_i inherit errors of the same order from the layers below. So
# the error is relative (a probability of 4.2e-6 moved by 1.4e-11, one of 0.646 by 1.7e-6: both about 3e-6), and the
# tolerance is rtol = 2 * T * eps, 6.2e-5 at T = 262: one T * eps for the sum, one for the logits (measured: at most
# 0.61 * T * eps over every layer, head and strategy). A fixed atol=1e-6 failed on that 0.646 by 1.67e-6.
def row_rtol(n: int) -> float:
    """The relative tolerance of float32 attention rows over ``n`` keys computed in two summation orders."""
    return 2 * n * float(np.finfo(np.float32).eps)


def ids(n, seed=0):
    return torch.randint(5, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("strategy", ["preallocated", "paged", "none"])
def test_the_overview_is_the_full_matrix_binned_and_the_recent_rows_are_its_rows(trained, small_bins, strategy):
    s = Session(trained, (strategy,), max_seq_len=320)
    s.prefill(ids(250))  # 250 rows: bins of 16 x 8; the steps cross 256 and the bins double
    for _ in range(12):
        s.step()
    store = s.reference.tracer.store
    tokens = s.reference.generator.tokens[:-1]
    T = len(tokens)
    assert store.rows == T == 262 and (store.rs, store.cs) == (32, 16)
    for layer, head in ((0, 0), (3, 5)):
        full = full_attention(trained, tokens, layer, head)
        mx, mean, cells = store.overview(layer, head, store.rs, store.cs, 0, 9, 0, 17)  # binned: float16
        np.testing.assert_allclose(mx, binned(full, 32, 16, "max"), rtol=1e-3, atol=1e-6)
        np.testing.assert_allclose(mean, binned(full, 32, 16, "mean"), rtol=3e-3, atol=1e-5)  # float16 means
        assert cells.sum() == T * (T + 1) // 2
        assert store.recent_rows(layer) == list(range(T - 4, T))
        for q in range(T - 4, T):
            np.testing.assert_allclose(store.row(layer, q)[head], full[q, : q + 1], rtol=row_rtol(T), atol=0)
        assert store.row(layer, T - 5) is None  # older rows are not kept at full resolution
        # coarser bins asked are combined from the stored ones exactly
        mx2, _, _ = store.overview(layer, head, 64, 64, 0, 5, 0, 5)
        np.testing.assert_allclose(mx2, binned(full, 64, 64, "max"), rtol=1e-3, atol=1e-6)


def test_a_rewind_drops_the_rows_and_the_overview_stays_the_binned_matrix(trained, small_bins):
    s = Session(trained, ("preallocated",), max_seq_len=320)
    s.prefill(ids(200))
    for _ in range(6):
        s.step()
    s.rewind(3)  # rows 0..202 stay; row bin 12 (rows 192..207) had rows 192..202 reduced: only 202 is still held
    for _ in range(4):
        s.step()
    store = s.reference.tracer.store
    tokens = s.reference.generator.tokens[:-1]
    assert (len(tokens), store.rs, store.cs, store.rows) == (207, 16, 8, 207)
    full = full_attention(trained, tokens, 2, 1)
    mx, mean, cells = store.overview(2, 1, 16, 8, 0, 13, 0, 26)
    np.testing.assert_allclose(mx[:12], binned(full, 16, 8, "max")[:12], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(mean[:12], binned(full, 16, 8, "mean")[:12], rtol=3e-3, atol=1e-5)
    # the bin the rewind cut holds the rows it still had (202, then the new 203..206), nothing of the dropped ones
    kept = full.copy()
    kept[192:202] = np.nan
    np.testing.assert_allclose(mx[12], binned(kept, 16, 8, "max")[12], rtol=1e-3, atol=1e-6)
    assert cells[12].sum() == sum(q + 1 for q in range(202, 207))


def test_zoom_recomputes_rows_no_longer_held_as_the_full_prefill(trained, small_bins):
    s = Session(trained, ("preallocated",), max_seq_len=320)
    s.prefill(ids(180))
    s.step()
    tokens = s.reference.generator.tokens[:-1]
    full = full_attention(trained, tokens, 4, 3)
    snap = snapshot.take(s, TokenStrip(), "preallocated", None, 4, 3,
                         zoom={"attention": {"xaxis2": (19.6, 45.2), "yaxis2": (54.4, 40.0)}})
    spec = attention.from_snapshot(snap)
    heat = spec.trace("history")
    # rows 40..54 x keys 20..45 at full resolution (at most 16 rows, 32 keys), recomputed (not among the recent rows)
    got = np.full((181, 181), np.nan)
    got[np.asarray(heat["y"], int), np.asarray(heat["x"], int)] = heat["z"]
    want = np.where(np.tril(np.ones_like(full, bool)), full, np.nan)
    np.testing.assert_allclose(got[40:55, 20:46], want[40:55, 20:46], atol=1e-5)
    assert set(np.asarray(heat["y"], int)) == set(range(40, 55)) and min(heat["x"]) == 20 and max(heat["x"]) == 45
    assert "recomputed" in spec.layout["title"]["text"]
    assert spec.layout["xaxis2"]["range"] == [19.6, 45.2] and spec.layout["yaxis2"]["range"] == [54.4, 40.0]
    # the recomputation itself, every row of a layer at full resolution
    lane = snap.lane.detail.attention
    mx, mean = lane.recompute(1, 0, 0, 181, 1, 1, 0, 181)
    ref = full_attention(trained, tokens, 1, 0)
    np.testing.assert_allclose(mx, np.where(np.tril(np.ones_like(ref, bool)), ref, np.nan), atol=1e-5)


@pytest.mark.long  # two traced lanes to 236 tokens
def test_held_memory_is_bounded_whatever_the_number_of_steps(trained, small_bins):
    s = Session(trained, ("preallocated", "paged"), max_seq_len=400)
    s.prefill(ids(140))  # 182 .. 236 tokens at the two checks: the same bins, the recent rows' room the same
    sizes = []
    c = trained.config
    for n in range(1, 3 * KEEP_STEPS + 1):
        s.step()
        if n in (KEEP_STEPS + 10, 3 * KEEP_STEPS):
            store = s.reference.tracer.store
            sizes.append(store.nbytes - store._recent.nbytes)
            assert store.nbytes <= store.bound(c.num_layers, c.num_heads, len(s.tokens))
            assert store._recent.shape[3] <= len(s.tokens) * 5 // 4 + 1  # the recent rows: the context's width
    assert sizes[0] == sizes[1]  # bins saturated: beyond the recent rows, more steps hold nothing more
    history = s.reference.history
    old, new = history[1].trace, history[-1].trace
    assert len(history._kept) == len(history) - KEEP_STEPS  # the older steps are kept compact, the newest as they are
    assert all(type(v) is SlotView for v in old.layer_slots) and type(old.layer_slots) is list
    assert isinstance(old.read_positions, range) and isinstance(new.read_positions, range)
    # a kept trace reads as before; its attention rows are no longer held, the newest step's are
    assert old.slots.positions[: len(s.tokens) - 100] == list(range(len(s.tokens) - 100))
    assert not old.has_attention(0) and new.has_attention(0)
    np.testing.assert_allclose(new.attention(0)[-1].sum(-1).numpy(), 1.0, atol=1e-5)


def test_the_view_at_full_resolution_draws_the_old_full_matrix(trained):
    s = Session(trained, ("preallocated", "sink"), max_seq_len=64, strategy_options={"sink": {"window": 12}})
    s.prefill("Call me Ishmael. Some years ago, never mind how long")
    for _ in range(6):
        s.step()
    tokens = s.reference.generator.tokens[:-1]
    for lane in ("preallocated", "sink"):
        snap = snapshot.take(s, TokenStrip(), lane, None, 2, 5)
        spec = attention.from_snapshot(snap)
        # the old drawing: every record's rows from a tracer that keeps them all
        options = {"window": 12} if lane == "sink" else {}
        gen = Generator(trained, make_cache(lane, trained, max_seq_len=64, **options),
                        tracer=Tracer({"cache", "attention"}))
        gen.prefill(s.reference.generator.prompt_tokens, force=s.reference.history[0].token_id)
        for r in s.reference.history[1:]:
            gen.step(force=r.token_id)
        old = attention.spec(gen.history, 2, 5)
        assert np.array_equal(grid(spec.trace("history")).shape, grid(old.trace("history")).shape)
        np.testing.assert_allclose(grid(spec.trace("history")), grid(old.trace("history")), atol=1e-6)
        np.testing.assert_allclose(spec.trace("current")["y"], old.trace("current")["y"], atol=1e-6)
        assert len(tokens) == len(set(spec.trace("history")["y"]))


def test_wide_slots_and_history_are_binned_with_the_bin_in_the_hover(trained, small_bins):
    s = Session(trained, ("preallocated",), max_seq_len=320)
    s.prefill(ids(150))
    s.step()
    snap = snapshot.take(s, TokenStrip(), "preallocated", None, 0, 0, max_bins=32)
    spec = attention.from_snapshot(snap)
    bar = spec.trace("current")
    assert len(bar["x"]) <= 32 and bar["width"] == 16  # 320 slots in bins of 16, each bar its bin's max
    assert bar["customdata"][1] == "slots 16–31 (16) · max" and "max p" in bar["hovertemplate"]
    row = s.reference.tracer.store.row(0, 150)[0]
    assert bar["y"][0] == pytest.approx(row[:16].max())
    heat = spec.trace("history")
    assert "max p" in heat["hovertemplate"] and "(16)" in heat["hovertemplate"]
    assert len(set(heat["y"])) <= 16 and len(set(heat["x"])) <= 32


def test_sinks_and_sliding_windows(zoo, small_bins):
    gpt = zoo.load("gpt_oss", layers=2)
    assert gpt.config.attention_sinks
    s = Session(gpt, ("preallocated",), max_seq_len=64)
    s.prefill(ids(30, 1))
    s.step()
    spec = attention.from_snapshot(snapshot.take(s, TokenStrip(), "preallocated", None, 1, 0))
    row = s.reference.tracer.store.row(1, 30)[0]
    assert spec.trace("sink")["y"][0] == pytest.approx(1 - row.sum(), abs=1e-5) and 1 - row.sum() > 1e-3
    shares = spec.trace("sink history")["z"]
    assert len(shares) == len(set(spec.trace("history")["y"])) == 16 and np.all((shares > 0) & (shares <= 1))
    assert shares[-1] == pytest.approx(1 - row.sum(), abs=1e-5)  # the last bin (rows 30, 31) holds row 30 alone

    gemma = zoo.load("gemma3", layers=6, sliding_window=4)
    s = Session(gemma, ("preallocated",), max_seq_len=80)
    s.prefill(ids(60, 2))
    s.step()
    tokens = s.reference.generator.tokens[:-1]
    store = s.reference.tracer.store
    for layer in (0, 5):  # a local layer (window 4) and the global one
        full = full_attention(gemma, tokens, layer, 1)
        mx, _, _ = store.overview(layer, 1, store.rs, store.cs, 0, -(-61 // store.rs), 0, -(-61 // store.cs))
        np.testing.assert_allclose(mx, binned(full, store.rs, store.cs, "max"), rtol=1e-3, atol=1e-6)


def test_a_kept_slot_view_reads_back_as_the_view(trained):
    gen = Generator(trained, make_cache("paged", trained, max_seq_len=64, block_size=4))
    gen.prefill("Call me Ishmael.")
    gen.run(5)
    view = gen.cache.inspect.slot_view()
    kept = keep_view(view)
    assert kept.view() == view and kept.nbytes < 8 * len(view.positions)


def test_the_explorer_widget_draws_from_the_store(trained):
    pytest.importorskip("ipywidgets")
    ex = kvexplore.Explorer(trained, strategies=("preallocated",), max_seq_len=96)
    ex.prefill(ids(60, 3))
    ex.step()
    ex.view = "attention"
    fig = ex.figures["attention"]
    assert len(set(fig.data[1].y)) == 61 and max(fig.data[1].x) == 60


def test_the_replay_of_a_long_explorer_run_draws_what_the_records_keep(trained, small_bins, monkeypatch):
    from kvexplore.replay import frames, snapshot_at
    from kvexplore.trace import kept

    monkeypatch.setattr(kept, "KEEP_STEPS", 4)
    s = Session(trained, ("preallocated", "paged"), max_seq_len=96, strategy_options={"paged": {"block_size": 8}})
    s.prefill(ids(40, 4))
    for _ in range(10):
        s.step()
    runs = s.runs()
    steps, _ = frames(runs, layer=1, head=2)
    assert len(steps) == 11
    old = attention.from_snapshot(snapshot_at(runs, 2, "paged", layer=1, head=2))
    assert "no longer held" in str(old.layout["annotations"]) and len(old.trace("history")["z"]) > 0
    new = attention.from_snapshot(snapshot_at(runs, 10, "paged", layer=1, head=2))
    want = runs["paged"][10].trace.physical_attention(1)[-1, 2]
    np.testing.assert_allclose(new.trace("current")["y"], want.numpy(), atol=1e-6)
    # the cache map of a kept step is drawn from its kept slots
    from kvexplore.views import cache_map
    assert len(runs["paged"]._kept) == 7 and type(runs["paged"][2].trace.layer_slots[0]) is SlotView
    cache_map.from_snapshot(snapshot_at(runs, 2, "paged", layer=1, head=2))


def test_a_zoom_without_recomputation_draws_the_stored_bins_and_says_so(trained, small_bins):
    s = Session(trained, ("preallocated",), max_seq_len=320)
    s.prefill(ids(200, 5))
    s.step()
    store = s.reference.tracer.store
    spec = attention.spec(s.reference.history, 0, 0, zoom={"xaxis2": (10, 14), "yaxis2": (100, 103)})
    assert "finer rows are not kept" in spec.layout["title"]["text"]
    heat = spec.trace("history")
    mx, _, _ = store.overview(0, 0, store.rs, store.cs, 0, 13, 0, 26)
    row_bin, col_bin = 96 // store.rs, 8 // store.cs  # the stored bins that hold rows 100..103, keys 10..14
    assert (store.rs, store.cs) == (16, 8) and len(heat["z"]) == 1
    assert heat["z"][0] == pytest.approx(mx[row_bin, col_bin])
