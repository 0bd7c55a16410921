"""The explorer widget without a browser, its session and lanes: pick a strategy, fork, load a model, attach a
generator, click the tabs and the prompt box; the lane kinds and the settings it refuses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

# first: importing it skips this module without the notebook extra (plotly, ipywidgets)
from explorer_support import CODE, PROMPT, click, explorer, shown, slot_row
from explorer_support import model  # noqa: F401  (the fixture)

import kvexplore
from kvexplore.views.spec import grid


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
    assert f"{cache.pool.free_blocks} free pages" in ex.figures["cache_map"].plot_layout.title.text
    assert slot_row(ex).count(CODE["free"]) == cache.inspect.slot_view().count("free")
    # forks get their own traces in the memory and compare figures
    names = [t.name for t in shown(ex, "memory").data]
    assert "reserved · paged fork 1" in names


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
