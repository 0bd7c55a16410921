"""A teacher's long prompt: the explorer's caches grow to hold it (up to the model's context, kvexplore/explorer/fit.py)
and say so; a prompt beyond the context is refused naming both sizes and changes nothing; ``kvexplore app``'s page
(kvexplore/explorer/app_page.py) shows every error on the page instead of failing its cell."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvexplore
from kvexplore.explorer import app_page
from kvexplore.explorer.fit import slots_for

TEXT = (Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text()


def _prompt(model, n: int) -> list[int]:
    ids = model.tokenizer.encode(TEXT)
    return (ids * (n // len(ids) + 1))[:n]


def test_slots_for_a_prompt():
    assert slots_for(100, 128, 1024) == 128  # fits with a slot to step into: the size asked
    assert slots_for(127, 128, 1024) == 128
    assert slots_for(128, 128, 1024) == 256  # the prompt and 128 more, a multiple of 64
    assert slots_for(300, 128, 1024) == 448
    assert slots_for(950, 128, 1024) == 1024  # at most the context
    assert slots_for(5000, 128, None) == 5184
    assert slots_for(2000, 4096, 1024) == 4096  # asked for more than the context: the user's choice stands
    with pytest.raises(kvexplore.SettingsError, match="the prompt has 1,024 tokens and the model reads at most 1,024"):
        slots_for(1024, 128, 1024)


@pytest.mark.long  # the fast tier's heaviest (1-3 s): a 600-token prompt; test_grow_false_keeps_the_size stays fast
def test_a_long_prompt_grows_the_caches_and_a_short_one_gives_back_the_size_asked(trained):
    ex = kvexplore.Explorer(trained, strategies=("preallocated", "paged", "sink"), max_seq_len=128,
                            strategy_options={"paged": {"block_size": 8}, "sink": {"sinks": 4, "window": 28}})
    ex.prefill(_prompt(trained, 600))
    lanes = ex.lanes
    assert ex.session.max_seq_len == 768 and lanes["preallocated"].cache.capacity == 768
    assert lanes["paged"].cache.capacity == 768 and lanes["sink"].cache.inspect.held == 32  # a ring keeps its own size
    assert ex.error == "" and len(ex.session.tokens) == 601  # the prompt and its first token
    ex.run(3)
    assert len(ex.session.tokens) == 604
    status = ex.controls["status"].value
    assert "cache holds 603 of 768 slots" in status
    assert "the caches grew from 128 to 768 slots to hold the 600-token prompt (max_seq_len=128)" in status
    ex.prefill("Call me Ishmael.")
    assert ex.session.max_seq_len == 128 and ex.lanes["preallocated"].cache.capacity == 128
    assert "grew" not in ex.controls["status"].value


@pytest.mark.long  # the fast tier's heaviest (1-3 s): a long prompt refused; test_grow_false_keeps_the_size stays fast
def test_a_prompt_beyond_the_context_is_refused_and_changes_nothing(trained):
    ex = kvexplore.Explorer(trained, strategies=("preallocated", "concat"), max_seq_len=128, prompt="Call me Ishmael.")
    ex.run(2)
    before = (ex.session.max_seq_len, list(ex.session.tokens), dict(ex.lanes), ex.lanes["preallocated"].cache.length)
    context = trained.config.max_position_embeddings
    with pytest.raises(kvexplore.SettingsError) as e:
        ex.prefill(_prompt(trained, context + 10))
    assert str(e.value) == (f"the prompt has {context + 10:,} tokens and the model reads at most {context:,} positions "
                            f"(its context): shorten the prompt to fewer than {context:,} tokens, or choose a model "
                            f"with a longer context")
    assert ex.error == str(e.value)  # on the page too
    assert (ex.session.max_seq_len, list(ex.session.tokens), dict(ex.lanes),
            ex.lanes["preallocated"].cache.length) == before
    ex.step()  # the explorer goes on where it was
    assert len(ex.session.tokens) == len(before[1]) + 1


def test_grow_false_keeps_the_size(trained):
    ex = kvexplore.Explorer(trained, strategies=("preallocated",), max_seq_len=64, grow=False)
    with pytest.raises(kvexplore.CacheFullError, match="at least 100"):
        ex.prefill(_prompt(trained, 100))
    assert ex.session.max_seq_len == 64 and ex.session.tokens == []


def test_the_app_page_prefills_what_the_command_line_passed():
    ex = app_page.app_explorer({"KVEXPLORE_APP_PROMPT": "Call me Ishmael.", "KVEXPLORE_APP_MAX_SEQ_LEN": "96"})
    assert isinstance(ex, kvexplore.Explorer) and list(ex.lanes) == ["preallocated", "concat", "paged"]
    assert ex.session.max_seq_len == 96 and len(ex.session.tokens) == len(ex.session.prompt_tokens) + 1
    assert ex.controls["prompt"].value == "Call me Ishmael." and ex.error == ""


def test_the_app_notebook_shows_the_explorer_before_it_prefills_then_goes_where_the_link_stands():
    """The app notebook's two cells: the explorer with the prompt in its box and nothing run (Voila draws it), then
    app_start prefills it and follows the link (its steps and lane)."""
    env = {"QUERY_STRING": "prompt=Call+me+Ishmael.&steps=3&lane=paged"}
    ex = app_page.app_explorer(env, start=False)
    assert ex.session.tokens == [] and ex.controls["prompt"].value == "Call me Ishmael."
    app_page.app_start(ex, env)
    assert len(ex.session.tokens) == len(ex.session.prompt_tokens) + 1 + 3 and ex.lane.name == "paged"
    assert app_page.app_view(ex) is ex.widget  # the live explorer alone: no static copy on a page with a kernel
    box = app_page.app_explorer({"KVEXPLORE_APP_MODEL": "no-such-model"}, start=False)
    app_page.app_start(box)  # nothing to prefill: the error box stays
    assert app_page.app_view(box) is box


def test_the_app_page_shows_a_prompt_it_cannot_prefill_in_the_explorer():
    text = TEXT * 2  # about 5,000 tokens: beyond the tiny model's 1,024 positions
    ex = app_page.app_explorer({"KVEXPLORE_APP_PROMPT": text})
    assert isinstance(ex, kvexplore.Explorer) and ex.session.tokens == []
    assert ex.controls["prompt"].value == text  # the prompt stays in its box, to shorten
    assert "shorten the prompt to fewer than 1,024 tokens" in ex.error
    assert "shorten the prompt" in ex.controls["error"].value  # the page's error line


def test_a_link_rebuilds_the_view_it_was_made_from_and_a_bad_one_says_what_it_takes():
    from kvexplore.explorer import app_link

    ex = app_page.app_explorer({"QUERY_STRING": "prompt=Call+me+Ishmael.&steps=5&lane=paged&with=concat&layer=3"
                                                "&head=1&tab=attention", "SCRIPT_NAME": "/"})
    assert ex.error == "" and len(ex.session.tokens) == len(ex.session.prompt_tokens) + 1 + 5
    assert (ex.lane.name, ex.side_by_side, ex.controls["layer"].value, ex.controls["head"].value, ex.view) == \
        ("paged", "concat", 3, 1, "attention")
    query = app_link.of(ex, {"source": "tiny", "max_seq_len": 128})
    again = app_page.app_explorer({"QUERY_STRING": query})
    assert again.session.tokens == ex.session.tokens and again.shown() == ex.shown()
    from kvexplore.explorer.inspect import plain

    drawn = lambda e: plain({k: s.traces for k, s in e.specs().items() if k in e.shown()})  # noqa: E731 (the
    # comparison's step times are measured, so they differ: it is not on screen here)
    assert "compare" not in ex.shown() and drawn(again) == drawn(ex)
    link = ex.widget.children[-1]  # the page's "link to this view" button and its line
    link.children[0].click()
    assert link.children[1].value.startswith('<a href="/?model=tiny&amp;strategies=preallocated%2Cconcat%2Cpaged')
    wrong = app_page.app_explorer({"QUERY_STRING": "layer=40&lane=paged"})
    assert "the link&#x27;s layer=&#x27;40&#x27;: a layer of this model (it has 6)" in wrong.controls["error"].value
    unknown = app_page.app_explorer({"QUERY_STRING": "stepz=4"})
    assert "which a link to the app does not carry: it takes model, strategies" in unknown.value


@pytest.mark.parametrize("env, message", [
    ({"KVEXPLORE_APP_MODEL": "no-such-model"}, "no-such-model"),
    ({"KVEXPLORE_APP_STRATEGIES": "preallocated,bogus"}, "bogus"),
    ({"KVEXPLORE_APP_MAX_SEQ_LEN": "lots"},
     "KVEXPLORE_APP_MAX_SEQ_LEN=&#x27;lots&#x27;: the caches&#x27; size must be"),
])
def test_the_app_page_shows_why_it_cannot_open_the_explorer(env, message):
    box = app_page.app_explorer(env)
    assert not isinstance(box, kvexplore.Explorer)
    assert 'class="kvx-app-error"' in box.value and message in box.value
    assert "kvexplore app --model M --strategies A,B --max-seq-len N --prompt TEXT" in box.value


def test_a_full_cache_in_the_page_says_what_to_do_in_the_explorer():
    ex = kvexplore.Explorer("tiny", strategies=("preallocated",), max_seq_len=8, grow=False, prompt=[5, 6, 7, 8, 9, 10])
    with pytest.raises(kvexplore.CacheFullError):
        for _ in range(4):
            ex.step()
    shown = ex.controls["error"].value
    assert "CacheFullError" in shown and "press Reset" in shown and "kvexplore app --max-seq-len N" in shown


def test_a_small_app_shrinks_the_sink_ring_so_it_evicts_while_a_full_lane_sits_out():
    """kvexplore app --max-seq-len 24 with a sink lane: its ring (4 + 252 at the app's sizes) shrinks to the 24 slots
    asked, so once the pre-allocated lane is full and sits out, the sink lane goes on evicting; a ring given on the
    command line is kept."""
    env = {"KVEXPLORE_APP_MAX_SEQ_LEN": "24", "KVEXPLORE_APP_STRATEGIES": "preallocated,sink"}
    assert app_page.settings(env)["strategy_options"]["sink"] == {"sinks": 4, "window": 20}
    given = {**env, "KVEXPLORE_APP_OPTIONS": '{"sink": {"window": 100}}'}
    assert app_page.settings(given)["strategy_options"]["sink"] == {"sinks": 4, "window": 100}
    ex = kvexplore.Explorer(**app_page.settings(env), prompt="Call me Ishmael.")
    ex.run(30)
    pre, sink = ex.lanes["preallocated"], ex.lanes["sink"]
    assert pre.full is not None and len(pre.generator.tokens) == 25 and ex.error == ""
    assert sink.full is None and len(sink.history) == 31 and len(sink.cache.evicted_positions) > 0
    assert "sitting out while the others go on" in ex.controls["error"].value


def test_fork_says_what_it_does_to_the_lane_shown_and_the_status_explains_slots_and_positions():
    ex = kvexplore.Explorer("tiny", strategies=("preallocated", "paged"), prompt="Call me Ishmael.",
                            strategy_options={"paged": {"block_size": 8}})
    assert "own copy of the cache" in ex.controls["fork"].tooltip
    ex.controls["lane"].value = "paged"
    assert "shares its pages" in ex.controls["fork"].tooltip and "from paged" in ex.controls["fork"].tooltip
    assert 'title="slots: the places in the cache' in ex.controls["status"].value
