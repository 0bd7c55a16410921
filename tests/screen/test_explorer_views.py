"""What the explorer's views draw, without a browser: the memory, attention, tensors and compare figures and
the cache map's zoom, checked against the caches and traces they show, and the figure state as the widget sends it."""

from __future__ import annotations

import math

import pytest
import torch

# first: importing it skips this module without the notebook extra (plotly, ipywidgets)
from explorer_support import CODE, PROMPT, explorer, shown
from explorer_support import model  # noqa: F401  (the fixture)

import kvexplore
from kvexplore.views import attention, cache_map
from kvexplore.views.spec import figure, grid


def test_figures_are_made_once_and_carry_the_specs_on_screen(model):
    from kvexplore.explorer.inspect import plain as _to_json

    ex = explorer(model, prompt=PROMPT)
    figs = dict(ex.figures)
    ex.run(3)
    assert ex.figures == figs and all(ex.figures[n] is f for n, f in figs.items())
    specs = ex.specs()
    for name in ex.shown():  # the synced state is the spec: traces and layout as they are
        state = ex.figures[name].figure
        assert len(state["data"]) == len(specs[name].traces)
        for sent, want in zip(state["data"], specs[name].traces):
            assert _to_json(sent) == _to_json(want), name
        assert state["layout"]["title"] == specs[name].layout["title"]
    before = ex.figures["tensors"].spec  # off screen: not redrawn every step...
    assert before.layout["title"]["text"] == specs["tensors"].layout["title"]["text"]
    ex.step()
    assert ex.figures["tensors"].spec is before
    ex.view = "tensors"  # ...until its tab is picked
    now = ex.specs(["tensors"])["tensors"]
    assert ex.figures["tensors"].spec is not before
    assert _to_json(ex.figures["tensors"].spec.traces) == _to_json(now.traces)
    assert ex.shown() == ["cache_map", "tensors"]


def test_memory_follows_the_formula(model):
    ex = explorer(model, prompt=PROMPT)
    ex.run(4)
    c = model.config
    fig = shown(ex, "memory")
    by_name = {t.name: t for t in fig.data}
    n = len(ex.lane.history)
    pre = by_name["reserved · preallocated"].y
    assert list(pre) == [kvexplore.kv_bytes(c, 48)] * n
    lengths = [r.cache_length for r in ex.lanes["concat"].history]
    assert list(by_name["reserved · concat"].y) == [kvexplore.kv_bytes(c, L) for L in lengths]
    assert list(by_name["analytic · preallocated"].y) == [kvexplore.kv_bytes(c, L) for L in lengths]
    # concatenation copies the whole cache every decode step; in place copies nothing
    copied = list(by_name["copied · concat"].y)
    assert copied[1:] == [kvexplore.kv_bytes(c, L - 1) for L in lengths[1:]]
    assert set(by_name["copied · preallocated"].y) == {0}


def test_equal_memory_lines_stay_distinguishable(model):
    """Lanes with the same bytes at every step (two strategies of one size, forks) lie on one line: each is drawn
    narrower than the one under it so every colour shows, its hover names the others, and the later lane's legend
    entry names the figures it shares with the earlier one; lanes that differ keep the plain width."""
    ex = explorer(model, strategies=("preallocated", "paged", "concat"), max_seq_len=48,
                  strategy_options={"paged": {"block_size": 48}}, prompt=PROMPT)
    ex.run(3)
    fig = shown(ex, "memory")
    by_name = {t.name: t for t in fig.data}
    pre, paged = by_name["reserved · preallocated"], by_name["reserved · paged"]
    assert list(pre.y) == list(paged.y)  # one page of 48 slots: the same reserved bytes as 48 pre-allocated slots
    assert (pre.line.width, paged.line.width) == (5, 2)  # the first drawn wider, under the second
    assert "(same as paged)" in pre.hovertemplate and "(same as preallocated)" in paged.hovertemplate
    assert by_name["reserved · concat"].line.width == 2 and "same as" not in by_name["reserved · concat"].hovertemplate
    held = [by_name[f"held · {n}"].y for n in ("preallocated", "paged")]
    legend = [t.name for t in fig.data if t.showlegend]
    paged = next(n for n in legend if n.startswith("paged"))
    assert paged.startswith("paged (= preallocated: ") and "reserved" in paged
    assert ("held, reserved" in paged) == (list(held[0]) == list(held[1]))
    assert not any("= paged" in n or "= concat" in n for n in legend)  # a lane names only an earlier one


def test_attention_rows_sum_to_one_and_layer_picker(model):
    ex = explorer(model, prompt=PROMPT)
    ex.run(3)
    ex.controls["layer"].value = 3
    ex.controls["head"].value = 5
    fig = shown(ex, "attention")
    assert "layer 3 · query head 5 (reads KV head 1)" in fig.plot_layout.title.text  # 8 heads over 2 kv heads
    bar = fig.data[0]
    assert sum(bar.y) == pytest.approx(1.0, abs=1e-5)
    history = grid(fig.data[1])
    assert len(history) == len(ex.lane.generator.tokens) - 1  # one row per token processed
    for row in history:
        assert sum(row) == pytest.approx(1.0, abs=1e-5)
    # row q attends to positions 0..q only (causal): nothing else is even sent
    assert all(x <= y for x, y in zip(fig.data[1].x, fig.data[1].y))
    gqa = fig.data[2].z
    assert [list(r) for r in gqa] == [[(2 if h == 5 else 1) if h // 4 == g else 0 for h in range(8)] for g in range(2)]
    # the current row is what the model computed: compare with the trace directly
    t = ex.lane.last.trace
    assert list(bar.y) == pytest.approx(t.physical_attention(3)[-1, 5].tolist())


def test_compare_exact_and_lossy(model):
    ex = explorer(model, strategies=("preallocated", "concat", "quantized", "none"), max_seq_len=64,
                  strategy_options={"quantized": {"bits": 4, "group_size": 8, "residual": 8}}, prompt=PROMPT)
    ex.run(24)
    lanes = ex.lanes
    assert set(lanes["concat"].kl[1:]) == {0.0} and all(lanes["concat"].top1[1:])
    assert max(lanes["none"].kl[1:]) < 1e-6
    assert max(lanes["quantized"].kl[1:]) > 1e-6  # int4 changes the distribution a little
    table = ex.compare_rows()
    assert [row[0] for row in table] == ["preallocated (ref.)", "concat", "quantized", "none"]
    assert table[1][1] == f"{len(lanes['concat'].history)}/{len(lanes['concat'].history)}"  # own choice = reference
    assert table[1][2] == "100.0%"
    assert "<td>concat</td>" in ex.controls["compare"].value and "kvx-compare-table" in ex.controls["compare"].value
    kl = {t.name: t for t in shown(ex, "compare").data}["KL · quantized"]
    assert list(kl.y) == lanes["quantized"].kl
    assert len(shown(ex, "tensors").data[2].z) == 0  # quantization error: only for the quantized lane
    ex.controls["lane"].value = "quantized"
    err = grid(shown(ex, "tensors").data[2])
    assert len(err) == model.config.num_kv_heads and err.max() > 0
    assert list(err[0]) == pytest.approx(ex.lane.cache.quantization.quantization_error(0)[0, 0].tolist())
    ex.controls["lane"].value = "none"
    notes = [a.text for a in ex.figures["cache_map"].plot_layout.annotations]
    assert any("no cache" in t for t in notes)


def test_tensor_norms_are_the_stored_keys(model):
    ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    ex.run(3)
    ex.controls["layer"].value = 2
    keys = ex.lane.cache.key(2)[0]  # (kv_heads, slots, head_dim), after RoPE
    trace = shown(ex, "tensors").data[0]
    n = ex.lane.cache.length
    expected = keys[:, :n].norm(dim=-1)
    got = torch.tensor(grid(trace)[:, :n])
    assert torch.allclose(got, expected, atol=1e-4)
    assert all(math.isnan(v) for v in grid(trace)[:, n:].reshape(-1))  # free slots are gaps
    assert trace.z.dtype == "float32" and trace.z.ndim == 1  # binary on the wire (JSON could not carry the NaN)


def test_views_are_pure_functions_of_records(model):
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=32),
                              tracer=kvexplore.Tracer(capture={"cache", "attention"}))
    gen.prefill(PROMPT)
    gen.run(2)
    spec = cache_map.spec(gen.history[-1], "preallocated", model.config.num_layers)
    row = [int(v) for v in grid(spec.trace("slots"))[0]]
    assert row.count(CODE["written"]) == 1 and row.count(CODE["read"]) == gen.cache.length - 1
    att = attention.spec(gen.history, layer=0, head=0, num_heads=8, gqa_groups=gen.history[-1].trace.gqa_groups)
    assert sum(att.trace("current")["y"]) == pytest.approx(1.0, abs=1e-5)
    fig = kvexplore.views.spec.figure(spec)  # a plain plotly figure, e.g. for a static report
    assert fig.data[0].type == "heatmap"


def _plain(v):
    """What the figure widget sends as JSON (``plot._to_json``), its binary buffers (where NaN is allowed) named."""
    from kvexplore.views.plot import _to_json

    def walk(x):
        if isinstance(x, dict):
            if isinstance(x.get("buffer"), memoryview):
                return "binary buffer"
            return {k: walk(y) for k, y in x.items()}
        if isinstance(x, list):
            return [walk(y) for y in x]
        return x

    return walk(_to_json(v))


@pytest.mark.long  # every view of six strategies
def test_every_view_is_json_safe_for_every_strategy(model):
    """The widget protocol is JSON without NaN/Infinity: one such value in a figure stops the widget syncing."""
    import json

    ex = explorer(model, strategies=("preallocated", "concat", "paged", "quantized", "sink", "none"), max_seq_len=40,
                  strategy_options={"paged": {"block_size": 8}, "sink": {"sinks": 2, "window": 14}},
                  prompt=PROMPT)
    ex.run(12)
    ex.rewind(2)
    ex.fork("paged")
    for lane in ex.lanes:
        ex.controls["lane"].value = lane
        ex.side_by_side = "sink"
        for name, spec in ex.specs().items():
            json.dumps(_plain({"traces": spec.traces, "layout": spec.layout}), allow_nan=False)
            figure(spec)  # every property is one plotly knows, with a valid value (the page draws specs as they are)


def test_the_figure_state_sends_numeric_arrays_as_binary_buffers():
    import numpy as np

    from kvexplore.views.plot import _to_json

    out = _to_json({"z": np.array([1.0, float("nan")], dtype=np.float32), "x": np.arange(3, dtype=np.int64),
                    "m": np.ones((2, 2), dtype=np.float32), "y": [1.5, float("nan"), None], "n": np.float32(2.5)})
    assert out["z"]["dtype"] == "float32" and out["z"]["shape"] == [2] and isinstance(out["z"]["buffer"], memoryview)
    assert np.isnan(np.frombuffer(out["z"]["buffer"], dtype=np.float32)[1])  # NaN travels in the buffer
    assert out["x"] == [0, 1, 2]  # int64: JavaScript has no typed array for it
    assert out["m"] == [[1.0, 1.0], [1.0, 1.0]]
    assert out["y"] == [1.5, None, None] and out["n"] == 2.5  # JSON has no NaN


def test_memory_view_on_cuda_draws_the_allocator(model):
    """Pure spec on made-up reports (no GPU needed): the third panel reads the allocator figures after each step."""
    from dataclasses import replace

    from kvexplore.views import memory

    gen = kvexplore.Generator(model, kvexplore.make_cache("concat", model))
    gen.prefill(PROMPT)
    gen.run(2)
    records = [replace(r, memory=replace(r.memory, cuda_now={"reserved_bytes": 2 ** 21 * (i + 1),
                                                              "allocated_bytes": 1000 * i,
                                                              "inactive_split_bytes": 7 * i}))
               for i, r in enumerate(gen.history)]
    spec = memory.spec({"concat": records}, cuda=True)
    assert list(spec.trace("allocator reserved · concat")["y"]) == [2 ** 21, 2 ** 22, 3 * 2 ** 21]
    assert list(spec.trace("fragmentation · concat")["y"]) == [0, 7, 14]
    assert spec.trace("allocator reserved · concat")["yaxis"] == "y3"
    assert "yaxis3" not in memory.spec({"concat": records}).layout


def test_compare_counts_a_forced_lanes_own_choice(model):
    from dataclasses import replace

    from kvexplore.views import compare

    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=64))
    gen.prefill(PROMPT)
    gen.run(3)
    ref = list(gen.history)
    other = kvexplore.Candidate(token_id=(ref[1].token_id + 1) % 4096, text="x", prob=0.9)
    # a forced lane holds the reference's tokens; at step 1 its own first choice was another token
    lane = [replace(r, top=[other, *r.top]) if r.step == 1 else r for r in ref]
    rows = compare.rows({"ref": ref, "lossy": lane}, {}, {}, "ref", forced={"lossy": {0, 1, 2, 3}})
    assert rows[1][1] == "3/4"
    assert compare.rows({"ref": ref, "lossy": lane}, {}, {}, "ref")[1][1] == "4/4"  # free lanes: the tokens held
    # a fork of a forced lane: the steps before the fork were forced, the later ones its own
    assert compare.rows({"ref": ref, "fork": lane}, {}, {}, "ref", forced={"fork": {0}})[1][1] == "4/4"


def test_display_sends_the_figures_current_state(model):
    """Voila runs the whole notebook before the page connects: what a figure shows must travel with the display,
    not only as the update messages sent while no view existed."""
    ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    ex.run(2)
    bundle = ex._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    state = ex.figures["cache_map"].figure["data"][0]
    assert len(state["z"]) == model.config.num_layers * 48  # every slot of every layer, not the empty first state
    title = ex.figures["cache_map"].figure["layout"]["title"]["text"]
    assert title.startswith("preallocated · step 2")


def test_a_wide_cache_is_shown_zoomed_to_its_used_slots(model):
    ex = explorer(model, strategies=("preallocated",), max_seq_len=512, prompt=PROMPT)
    ex.run(2)
    held = ex.lane.cache.length
    lo, hi = ex.figures["cache_map"].plot_layout.xaxis.range
    assert lo == -0.5 and held <= hi < 511 and hi == 63.5
    assert "slots 0..63 of 512 shown" in ex.figures["cache_map"].plot_layout.xaxis.title.text
    assert shown(ex, "tensors").plot_layout.xaxis.range == (-0.5, 63.5)
    small = explorer(model, strategies=("preallocated",), max_seq_len=48, prompt=PROMPT)
    assert small.figures["cache_map"].plot_layout.xaxis.range == (-0.5, 47.5)


def test_a_lossy_lane_says_what_it_did_and_an_error_of_zero_reads_as_none(model):
    """Below the comparison table each lossy lane says what it did so far; before its first block is quantized the
    quantized lane says why nothing is lost yet, and its error panel is drawn at the white end of its scale with
    that note (not as a solid colour); once it quantizes, the note names the positions and the panel its error."""
    ex = explorer(model, strategies=("preallocated", "quantized", "sink"), max_seq_len=64, prompt=PROMPT,
                  strategy_options={"quantized": {"bits": 4, "group_size": 8, "residual": 8},
                                    "sink": {"sinks": 2, "window": 8}})
    ex.controls["lane"].value = "quantized"
    ex.step()  # the prompt only: 9 positions, inside 8 + one block
    n = ex.lane.cache.length
    table = ex.controls["compare"].value
    assert (f"<b>quantized</b>: quantized cache: nothing quantized yet: all {n} positions are inside the residual"
            in table)
    assert f"<b>sink</b>: sink cache: nothing evicted yet: all {n} positions fit in 2 sinks + a window of 8" in table
    assert "<b>preallocated</b>" not in table.split("</table>")[1]  # an exact cache has nothing to say
    err = shown(ex, "tensors")
    heat = next(t for t in err.data if t.name == "quantization error")
    assert heat.zmax == 1.0 and max(heat.z) == 0
    assert "nothing quantized yet" in " ".join(a.text for a in err.plot_layout.annotations)
    ex.run(12)
    cache = ex.lane.cache
    assert f"positions 0..{cache.quantized_upto - 1} quantized to 4 bits" in ex.controls["compare"].value
    assert f"<b>sink</b>: sink cache: evicted {len(ex.lanes['sink'].cache.evicted_positions)} positions" in \
        ex.controls["compare"].value
    heat = next(t for t in shown(ex, "tensors").data if t.name == "quantization error")
    assert heat.zmax == pytest.approx(float(max(heat.z))) and heat.zmax > 0
    assert not shown(ex, "tensors").plot_layout.annotations
