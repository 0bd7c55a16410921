"""What a Step sends depends on the screen, not on the context: binned figures, zoom, and patches on a base.

- kvexplore.views.delta: applying the patch to its base gives exactly the kernel's figure, for random edit sequences
  (hypothesis), in Python and in the page's own JavaScript (run by node when it is installed).
- the cache map and the stored K/V views: beyond max_bins slots each cell is a bin (the dominant class, the mean
  norm), said in the hover; a zoom draws that range at full resolution.
- explorer.zoom() and the page's zoom messages: checked like every other input; the layout keeps the range.
- PlotWidget: a Step sends a patch much smaller than the figure, and base + patch is the figure.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvexplore
from kvexplore.errors import SettingsError
from kvexplore.views import cache_map, delta, tensors
from kvexplore.views.bins import plan
from kvexplore.views.palette import SLOT_CLASSES
from kvexplore.views.plot import PlotWidget, _to_json
from kvexplore.views.spec import FigureSpec

DTYPES = (np.int8, np.int32, np.float32)


# -- random figures and edits -------------------------------------------------------------------------------------
@st.composite
def figures(draw, like: dict | None = None):
    """A figure of 1-3 traces (numeric arrays, lists of text, nested customdata, numbers) and a layout; with
    ``like``, an edit of it (arrays spliced, grown, shrunk or retyped, properties added and removed)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def array(old=None):
        if old is not None and draw(st.booleans()):  # a local edit: what a Step does
            a = old.copy()
            at = int(rng.integers(0, len(a) + 1))
            grow = rng.integers(0, 4, endpoint=True)
            a = np.concatenate([a[:at], rng.integers(-5, 5, grow).astype(a.dtype), a[at + int(rng.integers(0, 3)):]])
            if len(a) and draw(st.booleans()):
                a[int(rng.integers(0, len(a)))] = 7
            return a
        dtype = DTYPES[draw(st.integers(0, len(DTYPES) - 1))]
        a = rng.integers(-5, 5, int(rng.integers(0, 40))).astype(dtype)
        if dtype == np.float32 and len(a):
            a[rng.random(len(a)) < 0.1] = np.nan
        return a

    def texts(old=None):
        if old is not None and draw(st.booleans()):
            out = list(old)
            for _ in range(int(rng.integers(0, 3))):
                at = int(rng.integers(0, len(out) + 1))
                out[at:at + int(rng.integers(0, 2))] = [f"t{rng.integers(0, 9)}"] * int(rng.integers(0, 2))
            return out
        return [f"t{i}" for i in rng.integers(0, 9, int(rng.integers(0, 20)))]

    n = len(like["data"]) if like is not None and draw(st.booleans()) else draw(st.integers(1, 3))
    data = []
    for i in range(n):
        old = like["data"][i] if like is not None and i < len(like["data"]) else {}
        t = {"type": old.get("type", draw(st.sampled_from(["heatmap", "scatter"])))}
        for key in ("x", "z"):
            if draw(st.integers(0, 5)):
                prev = old.get(key)
                t[key] = array(prev if isinstance(prev, np.ndarray) else None)
        if draw(st.integers(0, 3)):
            t["text"] = texts(old.get("text"))
        if draw(st.integers(0, 3)):
            prev = old.get("customdata")
            t["customdata"] = [texts(prev[0] if prev else None)]
        if draw(st.booleans()):
            t["name"] = draw(st.sampled_from(["a", "b"]))
        data.append(t)
    layout = {k: v for k, v in (like or {}).get("layout", {}).items() if draw(st.integers(0, 4))}
    if draw(st.booleans()):
        layout["title"] = {"text": f"step {draw(st.integers(0, 99))}"}
    if draw(st.booleans()):
        layout["xaxis"] = {"range": [draw(st.integers(-5, 5)), draw(st.integers(6, 99))]}
    return {"data": data, "layout": layout}


@st.composite
def edit_sequences(draw):
    figs = [draw(figures())]
    for _ in range(draw(st.integers(1, 6))):
        figs.append(draw(figures(figs[-1])))
    return figs


def same(a, b) -> bool:
    """Equal as the page gets them (the order of properties aside)."""
    return (json.dumps(_to_json(a), default=_buffer, sort_keys=True)
            == json.dumps(_to_json(b), default=_buffer, sort_keys=True))


def _buffer(v):
    mv = memoryview(v)
    return [str(mv.format), mv.tolist()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edit_sequences())
def test_a_patch_on_its_base_gives_the_figure_for_random_edit_sequences(figs):
    base = figs[0]
    for new in figs[1:]:
        patch = delta.diff(base, new)
        if patch is None:  # other traces: the figure becomes the base
            assert len(base["data"]) != len(new["data"]) or [t["type"] for t in base["data"]] != [
                t["type"] for t in new["data"]]
            base = new
            continue
        assert same(delta.apply(base, patch), new)
        as_json = json.loads(json.dumps(_plain(patch)))  # as JSON has it: arrays as lists
        assert same(_plain(delta.apply(base, as_json)), _plain(new))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edit_sequences())
def test_the_widget_sends_a_base_and_patches_whose_sum_is_every_figure(figs):
    w = PlotWidget(FigureSpec(figs[0]["data"], figs[0]["layout"]), "t")
    for new in figs[1:]:
        w.show(FigureSpec(new["data"], new["layout"]))
        assert w.patch["rev"] == w.base["rev"]
        got = delta.apply(w.base, w.patch)
        assert same({"data": got["data"], "layout": got["layout"]}, new)


def _plain(v):
    """``v`` as JSON has it (arrays as lists, NaN as None)."""
    if isinstance(v, np.ndarray):
        return [None if isinstance(x, float) and x != x else x for x in v.tolist()]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return v


def _typed(v):
    """``v`` for node: arrays as {"$a": dtype, "v": items} (the page gets them as typed arrays)."""
    if isinstance(v, np.ndarray):
        return {"$a": str(v.dtype), "v": _plain(v)}
    if isinstance(v, dict):
        return {k: _typed(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_typed(x) for x in v]
    return v


NODE_HARNESS = delta.APPLY_JS + r"""
const T = {int8: Int8Array, int32: Int32Array, float32: Float32Array};
const dec = (v) => Array.isArray(v) ? v.map(dec) : (v && typeof v === 'object') ?
  ('$a' in v ? T[v['$a']].from(v.v.map(x => x === null ? NaN : x)) :
   Object.fromEntries(Object.entries(v).map(([k, x]) => [k, dec(x)]))) : v;
const enc = (v) => ArrayBuffer.isView(v) ? Array.from(v, x => Number.isNaN(x) ? null : x) : Array.isArray(v) ?
  v.map(enc) : (v && typeof v === 'object') ? Object.fromEntries(Object.entries(v).map(([k, x]) => [k, enc(x)])) : v;
const cases = JSON.parse(require('fs').readFileSync(0, 'utf8'));
console.log(JSON.stringify(cases.map(([b, p]) => enc(applyPatch(dec(b), dec(p))))));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (the page's apply runs in it)")
def test_the_pages_javascript_applies_patches_as_python_does():
    cases, wants = [], []
    seqs = []

    @settings(max_examples=80, deadline=None, database=None)
    @given(edit_sequences())
    def collect(figs):
        seqs.append(figs)

    collect()
    for figs in seqs:
        for new in figs[1:]:
            patch = delta.diff(figs[0], new)
            if patch is not None:
                cases.append([_typed(figs[0]), _typed(patch)])
                wants.append(_plain(delta.apply(figs[0], patch)))
    assert len(cases) > 20
    out = subprocess.run(["node", "-e", NODE_HARNESS], input=json.dumps(cases), capture_output=True, text=True,
                         check=True, timeout=60)
    got = json.loads(out.stdout)
    for g, w in zip(got, wants, strict=True):
        assert g == w


# -- binned views ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def long_run(tiny):
    """The tiny model with 300 tokens in a paged cache (pages of 8), and its last record."""
    cache = kvexplore.make_cache("paged", tiny, max_seq_len=320, block_size=8)
    gen = kvexplore.Generator(tiny, cache, tracer=kvexplore.Tracer(capture={"cache", "memory"}))
    gen.prefill(list(range(5, 305)))
    gen.step()
    return gen


def test_the_cache_map_bins_slots_beyond_max_bins_with_the_dominant_class_said_in_the_hover(long_run, tiny):
    record = long_run.history[-1]
    layers = tiny.config.num_layers
    full = cache_map.spec(record, "paged", layers, max_bins=1000)
    small = cache_map.spec(record, "paged", layers, max_bins=16)
    classes = cache_map.slot_classes(record)
    n = len(classes)
    b = plan(0, n, 16)
    assert b.size > 1 and b.count <= 16
    heat = small.trace("slots")
    assert len(heat["z"]) == layers * b.count  # what is sent: bins, not slots
    assert len(full.trace("slots")["z"]) == layers * n
    # each bin's colour: its highest-ranked class (written > read > ...), as a loop over the slots says
    rank = cache_map.RANKED.split(" > ")
    row = small.trace("tokens")
    for i, x in enumerate(row["x"]):
        k = int((x - (b.size - 1) / 2) // b.size)
        members = classes[k * b.size:(k + 1) * b.size]
        want = min(members, key=rank.index)
        assert SLOT_CLASSES[int(row["z"][0][i])] == want
        hover = row["customdata"][0][i]
        first, last = k * b.size, min((k + 1) * b.size, n) - 1
        assert hover.startswith(f"slots {first}–{last} ({last - first + 1}): ")
        assert f"{members.count(want)} {want}" in hover and f"colour: {want}" in hover
    assert "bins of" in small.layout["xaxis"]["title"]["text"]
    assert f"the {b.size} slots around" in heat["hovertemplate"]
    # zoomed to 40 slots: each slot again, the range kept in the layout
    assert "bins of" in cache_map.spec(record, "paged", layers, max_bins=64).layout["xaxis"]["title"]["text"]
    zoomed = cache_map.spec(record, "paged", layers, token_texts=[f"w{i}" for i in range(400)],
                            zoom={"xaxis": (100.0, 139.0)}, max_bins=64)
    assert zoomed.layout["xaxis"]["range"] == [100.0, 139.0]
    row = zoomed.trace("tokens")
    assert list(row["x"]) == list(range(100, 140))
    assert row["customdata"][0][0].startswith("slot 100 · position")


def test_stored_kv_norms_are_binned_by_their_mean(long_run, tiny):
    record = long_run.history[-1]
    import torch

    slots = long_run.cache.inspect.slot_views()[0]
    norms = torch.rand(2, tiny.config.num_kv_heads, long_run.cache.length, generator=torch.Generator().manual_seed(0))
    norms[:, :, 40:50] = float("nan")  # nothing recorded there
    full = tensors.spec(record, norms, 0, slots=slots, max_bins=1000)
    small = tensors.spec(record, norms, 0, slots=slots, max_bins=16)
    b = plan(0, len(slots.positions), 16)
    kvh = tiny.config.num_kv_heads
    k_full = tensors.physical(norms[0], slots.positions)
    heat = small.trace("key norms")
    assert len(heat["z"]) == kvh * b.count
    for x, y, z in zip(heat["x"][:40], heat["y"][:40], heat["z"][:40]):
        k = int((x - (b.size - 1) / 2) // b.size)
        seg = k_full[y, k * b.size:(k + 1) * b.size]
        seg = seg[~np.isnan(seg)]
        assert (np.isnan(z) and not len(seg)) or z == pytest.approx(seg.mean(), rel=1e-5)
    assert "mean ‖k‖" in heat["hovertemplate"] and "mean" not in full.trace("key norms")["hovertemplate"]


# -- the explorer: zoom and what a Step sends ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def explorer(tiny):
    ex = kvexplore.Explorer(tiny, strategies=("preallocated", "paged"), max_seq_len=700)
    ex.prefill([5 + i % 300 for i in range(600)])
    return ex


def test_zoom_draws_the_range_at_full_resolution_and_bad_zooms_change_nothing(explorer):
    ex = explorer
    fig = ex.figures["cache_map"]
    assert "bins of 2" in fig.spec.layout["xaxis"]["title"]["text"]
    before = fig.spec
    for bad, why in ((dict(figure="cache", x=(0, 9)), "no figure 'cache'"),
                     (dict(figure="cache_map", x=(9, 0)), "low < high"),
                     (dict(figure="cache_map", x=(0, float("nan"))), "finite"),
                     (dict(figure="cache_map", x=(0, 9), xaxis7=(0, 1)), "no axis 'xaxis7'")):
        with pytest.raises(SettingsError, match=why):
            ex.zoom(**bad)
        assert fig.spec is before and ex.snapshot().zoom == {}
    ex.zoom("cache_map", x=(200, 299))
    spec = ex.specs(["cache_map"])["cache_map"]
    assert fig.spec.layout["xaxis"]["range"] == [200.0, 299.0] == spec.layout["xaxis"]["range"]
    assert list(fig.spec.trace("tokens")["x"]) == list(range(200, 300))
    # the page's own messages: a box zoom on the history (y reversed: high first), then a double-click
    ex.view = "attention"
    att = ex.figures["attention"]
    ex._zoom_message(att, {"event": "zoom", "ranges": {"xaxis2": [10, 90], "yaxis2": [590, 500]}}, [])
    assert ex.snapshot().zoom["attention"] == {"xaxis2": (10.0, 90.0), "yaxis2": (500.0, 590.0)}
    assert att.spec.layout["xaxis2"]["range"] == [10.0, 90.0] and att.spec.layout["yaxis2"]["range"] == [590.0, 500.0]
    ex._zoom_message(att, {"event": "zoom", "ranges": {"xaxis2": None, "yaxis2": None}}, [])
    ex._zoom_message(fig, {"event": "zoom", "ranges": {"xaxis": None}}, [])
    assert ex.snapshot().zoom == {} and fig.spec.layout["xaxis"]["range"] != [200.0, 299.0]
    ex._zoom_message(fig, {"event": "zoom", "ranges": {"xaxis": "everything"}}, [])  # a bad message: shown
    assert "give a range" in ex.error and ex.snapshot().zoom == {}
    ex.error = ""


def test_a_step_sends_a_patch_far_smaller_than_the_figure(explorer):
    ex = explorer
    fig = ex.figures["cache_map"]
    sent = []
    fig._send = lambda msg, buffers=None: sent.append(len(json.dumps(msg)) + sum(memoryview(b).nbytes
                                                                                 for b in buffers or ()))
    try:
        for _ in range(4):
            ex.step()
    finally:
        del fig._send
    whole = len(json.dumps(_to_json({"data": fig.spec.traces, "layout": fig.spec.layout}), default=_buffer))
    assert len(sent) == 4 and sorted(sent)[1] < whole / 5, (sent, whole)  # a rebase at most once in four
    got = delta.apply(fig.base, fig.patch)
    assert same({"data": got["data"], "layout": got["layout"]}, {"data": fig.spec.traces, "layout": fig.spec.layout})


def test_the_token_strip_shows_the_newest_tokens_only(explorer):
    from kvexplore.explorer.strip import SHOWN

    ex = explorer
    strip = ex.controls["tokens"].value
    total = len(ex.lane.generator.tokens)
    assert total > SHOWN and strip.count('class="kvx-tok') == SHOWN
    assert f"… {total - SHOWN:,} earlier tokens" in strip
    assert f"position {total - 2}" in strip and f'title="prompt · position {total - SHOWN - 1}"' not in strip
