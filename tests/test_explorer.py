"""The explorer widget without a browser: click its buttons, pick from its dropdowns, assert on the figures' data."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")
pytest.importorskip("ipywidgets")

import kvexplore  # noqa: E402
from kvexplore.views import attention, cache_map  # noqa: E402
from kvexplore.views.palette import SLOT_CLASSES  # noqa: E402
from kvexplore.views.spec import figure, grid  # noqa: E402

CODE = {name: i for i, name in enumerate(SLOT_CLASSES)}
PROMPT = "Call me Ishmael. Some years ago"


@pytest.fixture(scope="module")
def model(trained):
    return trained


def explorer(model, **kw):
    kw.setdefault("strategies", ("preallocated", "concat", "paged"))
    kw.setdefault("max_seq_len", 48)
    kw.setdefault("strategy_options", {"paged": {"block_size": 8}} if "paged" in kw["strategies"] else None)
    return kvexplore.Explorer(model, **kw)


def slot_rows(ex):
    return grid(ex.figures["cache_map"].data[0])


def slot_row(ex, layer=0):
    return [int(v) for v in slot_rows(ex)[layer]]


def shown(ex, view):
    """The figure of a tab's view, with that tab picked (a view off screen is drawn when its tab is picked)."""
    ex.view = view
    return ex.figures[view]


def click(ex, name):
    ex.controls[name].click()


def test_prefill_and_step_move_the_write_window_one_slot(model):
    ex = explorer(model)
    ex.controls["prompt"].value = PROMPT
    click(ex, "prefill")
    assert ex.error == ""
    n_prompt = len(ex.lane.generator.prompt_tokens)
    row = slot_row(ex)
    assert [i for i, c in enumerate(row) if c == CODE["written"]] == list(range(n_prompt))  # prefill wrote the prompt
    for k in range(3):
        click(ex, "step")
        row = slot_row(ex)
        pos = n_prompt + k  # the token chosen by the previous step is written now
        assert [i for i, c in enumerate(row) if c == CODE["written"]] == [pos]
        assert [i for i, c in enumerate(row) if c == CODE["read"]] == list(range(pos))
        assert row[pos + 1:] == [CODE["free"]] * (len(row) - pos - 1)
        title = ex.figures["cache_map"].plot_layout.title.text
        assert f"write narrow(2, {pos}, 1) · read narrow(2, 0, {pos + 1})" in title
        assert f"step {k + 1}" in ex.controls["status"].value
    # every layer row is the same slot map
    assert all([int(v) for v in r] == row for r in slot_rows(ex))
    assert len(slot_rows(ex)) == model.config.num_layers


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


def test_run_rewind_marks_stale_and_token_strip_follows(model):
    ex = explorer(model, prompt=PROMPT)
    ex.controls["run_n"].value = 5
    click(ex, "run")
    assert len(ex.lane.history) == 6
    strip = ex.controls["tokens"].value
    assert strip.count('class="kvx-tok') == len(ex.lane.generator.tokens)
    assert "candidates:" in strip and "position" in strip
    assert ex.controls["progress"].layout.display == "none"
    ex.controls["rewind_n"].value = 2
    click(ex, "rewind")
    row = slot_row(ex)
    assert row.count(CODE["stale"]) == 2
    assert row.count(CODE["written"]) == 0
    assert "after a rewind (2 stale)" in ex.figures["cache_map"].plot_layout.title.text
    assert ex.controls["tokens"].value.count('class="kvx-tok') == len(ex.lane.generator.tokens)
    click(ex, "step")  # the next write reuses the first stale slot
    row = slot_row(ex)
    assert row.count(CODE["stale"]) == 1 and row.count(CODE["written"]) == 1


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


def test_strategy_picker_and_fork_show_shared_pages(model):
    ex = explorer(model, prompt=PROMPT)
    ex.run(2)
    ex.controls["lane"].value = "paged"
    assert ex.figures["cache_map"].plot_layout.title.text.startswith("paged")
    assert "block table" in ex.figures["cache_map"].plot_layout.title.text
    held_at_fork = ex.lanes["paged"].cache.length
    click(ex, "fork")
    assert ex.controls["lane"].value == "paged fork 1"
    assert "paged fork 1" in ex.controls["lane"].options
    row = slot_row(ex)
    held = len(ex.lane.generator.tokens) - 1
    assert row.count(CODE["shared"]) == held  # every position's page is shared with the original
    click(ex, "step")  # both write their own next token: the shared partial page is copied once, by the first
    assert held_at_fork % 8 != 0  # (the fork happened mid-page)
    copied = [ex.lanes[n].last.memory.copied_bytes for n in ("paged", "paged fork 1")]
    # the filled slots of that page, once
    # (the lanes step in a rotating order: whichever wrote first)
    assert sorted(copied) == [0, kvexplore.kv_bytes(model.config, held_at_fork % 8)]
    # the original's map shows the pool as it is now, with the page its fork took after it stepped
    ex.controls["lane"].value = "paged"
    cache = ex.lanes["paged"].cache
    assert f"{cache.free_blocks} free pages" in ex.figures["cache_map"].plot_layout.title.text
    assert slot_row(ex).count(CODE["free"]) == cache.slot_view().count("free")
    # forks get their own traces in the memory and compare figures
    names = [t.name for t in shown(ex, "memory").data]
    assert "reserved · paged fork 1" in names


def test_errors_are_shown_and_change_nothing(model):
    ex = explorer(model, strategies=("preallocated", "paged"), max_seq_len=16, prompt="Call me Ishmael.")
    before = {n: (list(l.generator.tokens), l.cache.length) for n, l in ex.lanes.items()}
    ex.controls["run_n"].value = 50
    click(ex, "run")  # stops when every cache is full
    assert "cache full" in ex.error and "cache full" in ex.controls["error"].value
    after = {n: (list(l.generator.tokens), l.cache.length) for n, l in ex.lanes.items()}
    assert len({tuple(t) for t, _ in after.values()}) == 1  # both filled at the same token
    assert all(lane.full is None for lane in ex.lanes.values())  # the refused step marked nothing
    full = after["preallocated"]
    click(ex, "step")
    assert {n: (list(l.generator.tokens), l.cache.length) for n, l in ex.lanes.items()} == after
    ex.controls["prompt"].value = "   "
    click(ex, "prefill")
    assert "prompt is empty" in ex.controls["error"].value
    assert (list(ex.lane.generator.tokens), ex.lane.cache.length) == full
    ex.controls["rewind_n"].value = 99
    click(ex, "rewind")
    assert "cannot rewind 99" in ex.error
    click(ex, "reset")
    assert ex.error == "" and ex.controls["error"].value == ""
    assert before  # the explorer started from a prefilled state


def test_a_full_lane_sits_out_the_steps_and_the_others_go_on(model):
    """A cache that fills stops its own lane, not the class: the others step on (after the reference stopped, each
    on its own tokens, compared with nothing), the page says which lane sits out and what to do, and a Rewind
    gives it room again."""
    opts = {"paged": {"block_size": 8}, "sink": {"sinks": 1, "window": 6}}
    ex = explorer(model, strategies=("preallocated", "sink", "paged"), max_seq_len=16, grow=False,
                  strategy_options=opts, prompt=list(range(10, 20)))
    ex.run(12)
    ref, sink, paged = (ex.lanes[n] for n in ("preallocated", "sink", "paged"))
    assert ex.error == "" and ref.full is not None and paged.full is not None and sink.full is None
    assert len(ref.generator.tokens) == len(paged.generator.tokens) == 17  # the 16 slots and the newest token
    assert all(r.token_id == r.top[0].token_id for r in sink.history[7:])  # greedy: its own choices after
    assert len(sink.history) == 13 and sink.cache.evicted_count > 0
    # fed the reference's tokens and compared with it while it stepped, then neither
    assert sink.forced_at == set(range(7)) and sorted(sink.kl_at) == list(range(7))
    notice = ex.controls["error"].value
    assert "kvx-notice" in notice and "preallocated (all 16 slots, at step 6)" in notice
    assert "paged (all 16 slots, at step 6)" in notice and "Rewind gives it room again" in notice
    assert "kvexplore app --max-seq-len N" in notice
    ex.controls["lane"].value = "preallocated"
    assert "full: sits out the steps since step 6" in ex.controls["status"].value
    ex.rewind(2)
    assert ref.full is None and paged.full is None and ex.controls["error"].value == ""
    ex.step()  # the reference and paged step again, paged fed the reference's token; the sink on its own
    assert (len(ref.history), len(sink.history), len(paged.history)) == (6, 12, 6)
    assert 5 in paged.forced_at and 11 not in sink.forced_at and 11 not in sink.kl_at


def test_a_lane_failing_mid_step_rewinds_the_others(model, monkeypatch):
    ex = explorer(model, strategies=("preallocated", "concat", "quantized"), prompt=PROMPT)
    ex.run(2)
    state = {n: list(l.generator.tokens) for n, l in ex.lanes.items()}
    lengths = {n: l.cache.length for n, l in ex.lanes.items()}

    def broken(*a, **k):
        raise RuntimeError("simulated failure in the quantized cache")

    monkeypatch.setattr(ex.lanes["quantized"].cache, "write", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        ex.step()
    assert {n: list(l.generator.tokens) for n, l in ex.lanes.items()} == state
    assert {n: l.cache.length for n, l in ex.lanes.items()} == lengths
    monkeypatch.undo()
    ex.step()
    assert len({tuple(l.generator.tokens) for l in ex.lanes.values()}) == 1


def test_buttons_are_disabled_while_a_step_runs(model, monkeypatch):
    ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    seen = []
    real = ex.session.step

    def spy():
        seen.append([b.disabled for b in ex._buttons])
        with pytest.raises(RuntimeError, match="still running"):
            ex.step()  # a second operation while one runs is refused, not interleaved
        return real()

    monkeypatch.setattr(ex.session, "step", spy)
    click(ex, "step")
    assert seen == [[True] * len(ex._buttons)]
    assert not any(b.disabled for b in ex._buttons)
    assert len(ex.lane.history) == 2


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
    assert list(err[0]) == pytest.approx(ex.lane.cache.quantization_error(0)[0, 0].tolist())
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


def test_sink_lane_refuses_a_rewind_into_evicted_positions(model):
    ex = explorer(model, strategies=("preallocated", "sink"), max_seq_len=64,
                  strategy_options={"sink": {"sinks": 2, "window": 12}}, prompt="Call me Ishmael.")
    ex.run(14)
    tokens = {n: list(l.generator.tokens) for n, l in ex.lanes.items()}
    ex.controls["lane"].value = "sink"
    assert "evicted" in ex.figures["cache_map"].plot_layout.title.text
    with pytest.raises(ValueError, match="evicted"):
        ex.rewind(14)  # back to position 6, but 2..7 were evicted
    assert {n: list(l.generator.tokens) for n, l in ex.lanes.items()} == tokens
    ex.rewind(1)
    assert all(len(l.generator.tokens) == len(tokens["sink"]) - 1 for l in ex.lanes.values())


def test_chat_toggle_only_with_a_template(model):
    ex = explorer(model, strategies=("preallocated",))
    assert ex.controls["chat"].layout.display == "none"
    with pytest.raises(ValueError, match="no chat template"):
        ex.prefill("hello", chat=True)


def test_bad_arguments_are_named(model):
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        kvexplore.Explorer(model, strategies=("fast",))
    with pytest.raises(ValueError, match="layer 9 does not exist"):
        kvexplore.Explorer(model, layer=9)
    with pytest.raises(ValueError, match="unknown view"):
        kvexplore.Explorer(model, view="cache")


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


def test_ready_to_click_with_the_default_prompt(model):
    from kvexplore.explorer.widget import DEFAULT_PROMPT

    ex = explorer(model)
    assert ex.controls["prompt"].value == DEFAULT_PROMPT and ex.session.tokens == []
    assert "press Step" in ex.controls["status"].value
    click(ex, "step")  # nothing ran yet: Step prefills the box (its first token)
    assert ex.error == ""
    assert ex.session.prompt_tokens == explorer(model, prompt=DEFAULT_PROMPT).session.prompt_tokens
    assert [len(l.history) for l in ex.lanes.values()] == [1, 1, 1]
    click(ex, "step")
    assert [len(l.history) for l in ex.lanes.values()] == [2, 2, 2]
    fresh = explorer(model)
    fresh.run(3)  # Run too: the prefill, then steps, three tokens in all
    assert [len(l.history) for l in fresh.lanes.values()] == [3, 3, 3]
    empty = explorer(model)
    empty.controls["prompt"].value = "   "
    click(empty, "step")
    assert "the prompt is empty" in empty.error and empty.session.tokens == []
    assert "the prompt is empty" in empty.controls["error"].value


def test_tabs_side_by_side_and_presentation(model):
    ex = explorer(model, prompt=PROMPT)
    assert ex.view == "attention" and ex.shown() == ["cache_map", "attention"]
    for name in ("memory", "tensors", "compare", "attention"):
        ex.controls["view"].value = name  # a click on the tab
        assert ex.shown()[-1] == name
        assert ex._panel.children[-1] is ex.figures[name]
        assert ex.figures[name].spec.layout["title"] == ex.specs([name])[name].layout["title"]
    with pytest.raises(ValueError, match="unknown view 'heat'; choose from attention, memory, tensors, compare"):
        ex.view = "heat"
    with pytest.raises(ValueError, match="no strategy 'sink'"):
        ex.side_by_side = "sink"
    ex.side_by_side = "paged"
    assert ex.shown() == ["cache_map", "cache_map_b", "attention"]
    assert ex.figures["cache_map_b"].spec.layout["title"]["text"].startswith("paged · step 0")
    assert ex.figures["cache_map"].spec.layout["title"]["text"].startswith("preallocated · step 0")
    assert ex.figures["cache_map_b"].layout.display == ""
    ex.step()
    assert ex.figures["cache_map_b"].spec.layout["title"]["text"].startswith("paged · step 1")
    ex.side_by_side = None
    assert ex.figures["cache_map_b"].layout.display == "none" and ex.shown() == ["cache_map", "attention"]
    ex.presentation = True
    assert all(ex.controls[n].layout.display == "none" for n in ("settings", "fork"))
    spec = ex.figures["cache_map"].spec
    assert spec.layout["font"]["size"] == 18 and spec.layout["legend"]["font"]["size"] == 18
    assert spec.layout["title"]["font"]["size"] == 20
    assert ex.figures["cache_map"].spec.trace("free")["marker"]["size"] == 19  # legend squares 12 -> 19
    assert "kvx-presenting" in ex.widget._dom_classes
    ex.presentation = False
    assert ex.controls["fork"].layout.display == "" and "font" not in ex.figures["cache_map"].spec.layout


def test_lanes_step_in_a_rotating_order(model):
    ex = explorer(model, strategies=("preallocated", "concat", "paged"), prompt=PROMPT)
    orders = []
    for _ in range(3):
        orders.append([lane.name for lane in ex.session.step_order()])
        ex.step()
    assert orders == [["preallocated", "concat", "paged"], ["preallocated", "paged", "concat"],
                      ["preallocated", "concat", "paged"]]


def test_two_exact_lanes_report_comparable_times(model):
    """Timed in a rotating order, forward pass only, after a warm-up when idle: two exact caches of the same size
    must not look several times apart (a cold first lane once showed 145 ms against 21 ms)."""
    import statistics

    ex = explorer(model, strategies=("preallocated", "paged"), prompt=PROMPT, max_seq_len=64)
    ex.run(30)
    med = {n: statistics.median(r.forward_s for r in l.history if r.kind == "decode") for n, l in ex.lanes.items()}
    ratio = max(med.values()) / min(med.values())
    assert ratio < 1.5, f"median forward times {med} differ {ratio:.2f}x"
    row = {r[0].replace(" (ref.)", ""): r for r in ex.compare_rows()}
    assert "(" in row["paged"][4] and "–" in row["paged"][4]  # median (25th–75th percentile)


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


def test_an_existing_generator_becomes_the_reference_lane(model):
    gen = kvexplore.Generator(model, kvexplore.make_cache("paged", model, max_seq_len=64, block_size=8))
    gen.prefill(PROMPT)
    gen.run(3)
    ex = kvexplore.Explorer(gen, strategies=("paged", "preallocated"), max_seq_len=64)
    assert list(ex.lanes) == ["paged", "preallocated"] and ex.lanes["paged"].generator is gen
    # the other strategy replayed the generator's tokens, so the lanes step on together
    assert ex.lanes["preallocated"].generator.tokens == gen.tokens
    ex.step()
    assert ex.lanes["preallocated"].generator.tokens == gen.tokens and len(gen.history) == 5
    assert ex.lanes["preallocated"].kl[-1] < 1e-6  # compared from the first step after the replay
    assert gen.tracer is ex.lanes["paged"].tracer and gen.history[-1].trace is not None


def test_forced_tokens_are_checked(model):
    gen = kvexplore.Generator(model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.prefill(PROMPT, force=10 ** 6)
    record = gen.prefill(PROMPT, force=7)
    assert record.token_id == 7 and gen.tokens[-1] == 7
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen.step(force=-1)
    assert gen.tokens[-1] == 7 and len(gen.history) == 1


def test_a_step_refused_because_every_cache_is_full_touches_no_lane(model):
    """Found in review: the paged pool had already moved when the step was refused."""
    from kvexplore.explorer import Session

    s = Session(model, ("paged", "preallocated"), max_seq_len=16, grow=False)
    s.prefill(list(range(10, 20)))
    while True:
        try:
            s.step()
        except kvexplore.CacheFullError:
            break
    paged = s.lanes["paged"].cache
    before = (paged.length, paged.slot_view().states, [lane.full for lane in s.lanes.values()])
    with pytest.raises(kvexplore.CacheFullError):
        s.step()
    assert (paged.length, paged.slot_view().states, [lane.full for lane in s.lanes.values()]) == before


def test_a_rewind_drops_a_forks_comparison_figures_from_the_abandoned_path(model):
    """Found in review: a fork kept the figures it had compared on a path that a rewind abandoned."""
    from kvexplore.explorer import Session

    s = Session(model, ("preallocated", "sink"), max_seq_len=64, strategy_options={"sink": {"sinks": 1, "window": 6}})
    s.prefill(list(range(10, 16)))
    for _ in range(6):
        s.step()
    fork = s.fork("sink")
    s.rewind(5)
    assert all(k < len(fork.history) for k in fork.kl_at)
    for _ in range(6):
        s.step()
    ref = s.reference.generator.tokens
    for r, kl in zip(fork.history, fork.kl):
        if kl is not None:
            assert fork.generator.tokens[: r.position] == ref[: r.position]  # compared only on the same context


def test_without_a_cache_a_decode_step_keeps_only_its_newest_attention_row(model):
    """Found in review: the lane without a cache kept each decode step's whole T x S attention matrix."""
    from kvexplore.explorer import Session

    s = Session(model, ("preallocated", "none"), max_seq_len=64)
    s.prefill(PROMPT)
    for _ in range(20):
        s.step()
    none, pre = s.lanes["none"].tracer.history.nbytes, s.lanes["preallocated"].tracer.history.nbytes
    assert none == pre
    last = s.lanes["none"].last.trace
    assert torch.allclose(last.attention(0)[-1], s.lanes["preallocated"].last.trace.attention(0)[-1], atol=1e-5)


def test_rewinding_every_generated_token_leaves_the_prompt_and_step_continues_from_it(model):
    """Found in review: after the rewind the status says nothing is generated yet, and Step runs without an error."""
    ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    ex.run(2)
    ex.rewind(3)
    assert "nothing generated yet" in ex.controls["status"].value
    ex.step()
    assert len(ex.lane.history) == 1 and ex.error == ""


def test_a_strategy_may_have_a_size_of_its_own(model):
    """Found in review: the ``max_seq_len`` in a strategy's options sizes its cache, not the session's."""
    ex = explorer(model, strategies=("preallocated", "sink"), max_seq_len=48,
                  strategy_options={"sink": {"max_seq_len": 20}}, prompt=PROMPT)
    assert ex.lanes["sink"].cache.window == 16


def test_loading_a_model_keeps_the_pickers_and_the_seed(model):
    ex = explorer(model, strategies=("preallocated",), layer=3, head=2, prompt=PROMPT)
    ex.controls["seed"].value = 7
    ex.load_model(model)
    assert (ex.layer, ex.head, ex.controls["layer"].value, ex.controls["head"].value) == (3, 2, 3, 2)
    assert ex.session.seed == 7


def test_an_attached_generator_keeps_its_sampling(model):
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=64), temperature=1.5,
                              top_k=50, seed=3)
    gen.prefill(PROMPT)
    gen.run(2)
    ex = kvexplore.Explorer(gen, strategies=("preallocated", "concat"), max_seq_len=64)
    assert (ex.controls["temperature"].value, ex.controls["top_k"].value, ex.controls["seed"].value) == (1.5, 50, 3)
    assert ex.lanes["concat"].generator.sampling == gen.sampling
    ex.run(4)
    assert ex.lanes["concat"].generator.tokens == gen.tokens  # fed the reference's tokens
    assert all(math.isnan(v) for v in grid(shown(ex, "tensors").data[0])[0, :3])  # before it attached: no norms


def test_lane_kinds_come_from_the_registry(model, monkeypatch):
    from kvexplore.explorer import lanes
    from kvexplore.explorer.session import Session

    assert [lanes.lane_kind(s).name for s in ("preallocated", "none", "compiled", "hf:static")] == \
        ["eager", "eager", "compiled", "transformers"]
    with pytest.raises(kvexplore.SettingsError, match="unknown strategy 'nope'; available: preallocated, .*compiled"):
        lanes.lane_kind("nope")

    class Mirror(lanes.EagerLanes):
        """A toy lane kind: "mirror" runs the concatenating cache under its own name."""
        name = "mirror"

        def claims(self, strategy):
            return strategy == "mirror"

        def cache_strategy(self, strategy):
            return "concat"

    monkeypatch.setattr(lanes, "LANE_KINDS", [Mirror(), *lanes.LANE_KINDS])
    s = Session(model, ("preallocated", "mirror"), max_seq_len=48)
    s.prefill(PROMPT)
    for _ in range(4):
        s.step()
    mirror = s.lanes["mirror"]
    assert type(mirror.cache).__name__ == "ConcatCache" and mirror.lane_kind.name == "mirror"
    assert mirror.generator.tokens == s.reference.generator.tokens and max(mirror.kl[1:]) < 1e-6


def test_a_fork_is_marked_as_one_and_a_cache_that_keeps_nothing_says_so(model):
    from kvexplore.explorer.session import Session

    s = Session(model, ("preallocated", "none"), max_seq_len=48)
    s.prefill(PROMPT)
    s.step()
    # the cache that kept nothing of the prefill: its tracer keeps the newest attention row only, and it cannot fork
    assert s.lanes["none"].tracer.last_row_only and not s.lanes["preallocated"].tracer.last_row_only
    with pytest.raises(kvexplore.SettingsError, match="nothing to fork"):
        s.fork("none")
    first, second = s.fork(), s.fork("preallocated fork 1")
    assert (first.name, first.fork_of, second.name, second.fork_of) == \
        ("preallocated fork 1", "preallocated", "preallocated fork 2", "preallocated fork 1")
    assert first.is_fork and not s.reference.is_fork and first.kind == "preallocated"
    s.reset()
    assert list(s.lanes) == ["preallocated", "none"]
    s.prefill(PROMPT)
    assert s.fork().name == "preallocated fork 1"  # numbered again from the new sequence


def test_the_explorer_loads_a_named_model_through_the_loader(monkeypatch, model):
    from kvexplore.explorer import models

    asked = []

    def load(source, dtype=None, device=None):
        asked.append((source, dtype, device))
        return model

    monkeypatch.setattr(models, "load", load)
    ex = kvexplore.Explorer("tiny", strategies=("preallocated",), max_seq_len=32, dtype="float32")
    assert asked == [("tiny", "float32", None)] and ex.model is model
    opened = models.open_source(model)
    assert (opened.model, opened.hf, opened.generator, opened.strategies) == (model, None, None, ("preallocated",))


def test_the_model_picker_names_the_running_model(trained, checkpoint):
    """The picker said "tiny" whatever model ran (a SmolLM2 or Gemma 3 object, a folder): it names the running model,
    and Load on it opens it again, or, for a model that came as an object without a path, says it cannot."""
    named = [(n, n) for n in ("tiny", "smollm2-135m", "gemma3-270m")]
    ex = kvexplore.Explorer(trained, strategies=("preallocated",))  # the packaged tiny, as an object
    assert (ex.controls["model"].value, list(ex.controls["model"].options)) == ("tiny", named)
    folder = str(checkpoint("llama-gqa2")[0])
    ex = kvexplore.Explorer(folder, strategies=("preallocated",))
    entry = (f"{Path(folder).name} (this model)", folder)
    assert ex.controls["model"].value == folder and list(ex.controls["model"].options) == [entry, *named]
    ex.load_model("tiny")
    assert ex.controls["model"].value == "tiny" and ex.model.config.vocab_size == trained.config.vocab_size
    ex.load_model(folder)  # Load on the folder's entry opens it again
    assert ex.controls["model"].value == folder and ex.model.source == folder
    bare = kvexplore.load(folder)
    bare.source = None
    ex = kvexplore.Explorer(bare, strategies=("preallocated",), prompt="Call me")
    assert ex.controls["model"].options[0] == ("LlamaForCausalLM (this model)", "")
    tokens = list(ex.session.tokens)
    with pytest.raises(kvexplore.SettingsError, match="it cannot be loaded again; choose a named model"):
        ex.load_model(ex.controls["model"].value)
    assert ex.session.tokens == tokens and ex.model is bare and "cannot be loaded again" in ex.error


@pytest.mark.long  # the fast tier's heaviest (1-3 s): every strategy to the end of sequence
def test_status_and_map_title_give_one_slot_figure_and_the_end_of_sequence(model):
    """The status line and the cache map's title count the same slots (the first full layer's physical slots) for
    every strategy, the sequence's limit in positions named as positions where it differs; at the end-of-sequence
    token the status says the model has finished and that Step goes on, and after it how long ago it ended."""
    import re

    ex = explorer(model, strategies=("preallocated", "concat", "paged", "quantized", "sink", "evict", "none"),
                  max_seq_len=40, strategy_options={"paged": {"block_size": 16}, "sink": {"sinks": 2, "window": 14},
                                                    "quantized": {"residual": 8}},
                  prompt=PROMPT)
    ex.run(12)
    seen = {}
    for lane in ex.lanes:
        ex.controls["lane"].value = lane
        status = re.sub(r"<[^>]+>", "", ex.controls["status"].value)  # the text on screen (its hover aside)
        title = ex.figures["cache_map"].plot_layout.title.text
        view = ex.lanes[lane].cache.slot_view()
        held, total = re.search(r"step 12 · (\d+)/(\d+) slots held", title).groups()
        assert (int(held), int(total)) == (view.held, len(view.states))
        seen[lane] = status
        if total != "0":
            assert f"cache holds {held} of {total} slots" in status
        else:
            assert "cache keeps no slots" in status
    assert "of 48 slots · sequence limit 40 positions" in seen["paged"]  # 3 pages of 16 slots
    assert "holds 16 of 16 slots" in seen["sink"] and "limit" not in seen["sink"]  # 2 sinks + a 14-slot ring
    assert "unbounded" not in "".join(seen.values())
    # the end of sequence: a token this prompt's greedy run produces is made to count as one
    first = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    first.run(6)
    tokens = [r.token_id for r in first.lane.history]
    eos = model.tokenizer.eos_ids
    model.tokenizer.eos_ids = [tokens[3]]
    try:
        ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
        ex.run(6)  # stops at the end of sequence
        ended = ex.lane.history[-1]
        assert ended.is_eos and ended.token_id == tokens[3] and tokens.index(tokens[3]) == len(ex.lane.history) - 1
        assert "end of sequence: the model has finished (press Continue to go on past it)" in \
            ex.controls["status"].value
        assert ex.controls["step"].description == "Continue" and "past it" in ex.controls["step"].tooltip
        click(ex, "step")
        assert ex.controls["step"].description == "Step"
        assert ex.lane.history[-2] is ended and not ex.lane.history[-1].is_eos
        ended = ended.step
        assert f"past the end of sequence (step {ended} ended it)" in ex.controls["status"].value
    finally:
        model.tokenizer.eos_ids = eos


def test_an_explorer_displayed_twice_says_it_is_the_same_live_one(model, monkeypatch):
    import IPython.display

    ex = explorer(model, strategies=("preallocated",), prompt=PROMPT)
    shown_objects = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown_objects.append(obj))
    ex._ipython_display_()
    assert shown_objects[0] is ex.widget  # the first display: the widget, no note
    shown_objects.clear()
    ex._ipython_display_()
    note, widget = shown_objects[:2]
    assert widget is ex.widget
    assert "The same live explorer as displayed above (display 2)" in note.data and "fork()" in note.data


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
    assert f"<b>sink</b>: sink cache: evicted {ex.lanes['sink'].cache.evicted_count} positions" in \
        ex.controls["compare"].value
    heat = next(t for t in shown(ex, "tensors").data if t.name == "quantization error")
    assert heat.zmax == pytest.approx(float(max(heat.z))) and heat.zmax > 0
    assert not shown(ex, "tensors").plot_layout.annotations


def test_tabs_that_apply_to_no_lane_are_hidden(model):
    """Four tabs for exact lanes; the press views appear once an evict lane has pressed (the tab on screen stays
    where it was while they do), the speculation view with a lane that drafts; a hidden view asked for by name is
    added and shown."""
    names = lambda ex: [v for _, v in ex.controls["view"].options]  # noqa: E731
    plain = explorer(model, strategies=("preallocated", "paged"), prompt=PROMPT)
    plain.run(2)
    assert names(plain) == ["attention", "memory", "tensors", "compare"]
    pressing = explorer(model, strategies=("preallocated", "evict"))  # nothing run yet
    pressing.view = "memory"
    assert names(pressing) == ["attention", "memory", "tensors", "compare"]  # nothing pressed yet
    pressing.step()
    assert names(pressing) == ["attention", "memory", "tensors", "compare", "press", "kept", "eviction"]
    assert pressing.view == "memory" and pressing._panel.children[-1] is pressing.figures["memory"]
    drafting = explorer(model, strategies=("preallocated", "preallocated@spec"),
                        strategy_options={"preallocated@spec": {"draft": "prompt-lookup"}})
    assert names(drafting)[-1] == "speculation"  # a lane that drafts: its tab before its first verification
    plain.view = "speculation"  # asked for by name: shown, with its tab
    assert "speculation" in names(plain) and plain._panel.children[-1] is plain.figures["speculation"]


def test_a_prompt_of_token_ids_is_run_as_given_and_shown_as_text(model):
    ids = model.tokenizer.encode(PROMPT)[:5]
    ex = explorer(model, strategies=("preallocated",), prompt=ids)
    assert ex.error == "" and ex.lane.generator.prompt_tokens == ids
    assert ex.controls["prompt"].value == model.tokenizer.decode(ids)
    ex.prefill(ids[:3])
    assert ex.lane.generator.prompt_tokens == ids[:3] and ex.controls["prompt"].value == model.tokenizer.decode(ids[:3])


def test_the_prompt_box_takes_the_newest_edit_and_the_text_sent_with_a_click(model):
    """The page sends each edit of the prompt box stamped, and a click on Prefill, Step or Run with the text: the kernel
    keeps the newest edit (one handled late leaves the newer text), runs the click on the text that came with it, and
    a message without text changes nothing."""
    from kvexplore.runtime.prompt import prompt_ids

    ex = explorer(model)
    box = ex.controls["prompt"]
    assert box.clicks == ["prefill", "step", "run"]
    for stamp, text in ((1, "Call"), (3, "Call me"), (2, "Cal")):  # the third was sent before the second
        box._message(box, {"value": text, "n": stamp}, [])
    assert box.value == "Call me"
    for bad in ({"value": 3, "n": 4}, {"other": "x"}, "text", {"value": None, "click": "prefill"}):
        box._message(box, bad, [])
        assert box.value == "Call me" and ex.lane.generator.tokens == []
    box._message(box, {"value": PROMPT, "n": 5, "click": "prefill"}, [])
    want = prompt_ids(PROMPT, lambda: model.tokenizer, model.config.vocab_size)
    assert ex.error == "" and ex.lane.generator.prompt_tokens == want and box.value == PROMPT
    box._message(box, {"value": "Call me Ishmael", "n": 4, "click": "step"}, [])  # late: the click, not the text
    assert len(ex.lane.generator.tokens) == len(want) + 2 and box.value == PROMPT
