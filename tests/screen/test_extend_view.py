"""A view added from outside the package: defined in this module only, registered with
``kvexplore.views.registry.register``, and then drawn by the explorer widget, the HTML replay (its frames and its
page), a history's ``save_html`` and the notebook's static copy, with no change to kvexplore.

The toy view is a bar per layer of the bytes of keys and values the lane's cache wrote in the last step, from the
record's memory report; the tests hold it to the formula ``2 * kv_heads * head_dim * element_size * positions fed``.
"""

from __future__ import annotations

import base64
import gzip
import json
import re

import pytest

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")
pytest.importorskip("ipywidgets")

import kvexplore  # noqa: E402
from kvexplore.replay import frames, save_html  # noqa: E402
from kvexplore.views.registry import PER_LANE, TABS, VIEWS, View, register, unregister  # noqa: E402
from kvexplore.views.spec import FigureSpec  # noqa: E402
from replay_support import ROOT, open_replay  # noqa: E402

PROMPT = "Call me Ishmael. Some years ago"
NAME = "bytes_written"


def bytes_written(snapshot) -> FigureSpec:
    """The toy view: bytes written per layer by the shown lane's last step."""
    record = snapshot.lane.last
    layers = list(record.memory.layers) if record is not None and record.memory is not None else []
    bar = dict(type="bar", name="written", x=[m.layer for m in layers], y=[m.written_bytes for m in layers])
    title = f"bytes written by step {record.step}" if record is not None else "no step yet"
    return FigureSpec([bar], dict(title=dict(text=title), xaxis=dict(title=dict(text="layer"))))


@pytest.fixture
def toy_view():
    view = register(View(NAME, "Bytes written", bytes_written, replay=PER_LANE))
    try:
        yield view
    finally:
        unregister(NAME)


@pytest.fixture(scope="module")
def model(trained):
    return trained


def expected(model, positions: int) -> list[int]:
    """Bytes a step feeding ``positions`` tokens writes into each layer of a float32 cache that stores every
    position (the pre-allocated and concatenating caches)."""
    c = model.config
    return [2 * c.layer_kv_heads(i) * c.head_dim * 4 * positions for i in range(c.num_layers)]


def run(model, kind: str, steps: int):
    g = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=64),
                            tracer=kvexplore.Tracer(capture={"cache", "attention", "memory"}))
    g.prefill(PROMPT)
    g.run(steps - 1, stop_at_eos=False)
    return g.history


def unpack(page: str, which: int = 0) -> dict:
    """The data of the ``which``-th replay fragment in ``page`` (gzip and base64, as the player reads it)."""
    packed = re.findall(r'class="kvx-data">([^<]+)</script>', page)[which]
    return json.loads(gzip.decompress(base64.b64decode(packed)))


def test_a_registered_view_is_a_figure_and_a_tab_of_the_explorer(model, toy_view):
    assert NAME in TABS and VIEWS[NAME] is toy_view
    ex = kvexplore.Explorer(model, strategies=("preallocated", "concat"), max_seq_len=48, prompt=PROMPT)
    prompt_len = len(ex.session.prompt_tokens)
    assert ("Bytes written", NAME) in ex.controls["view"].options
    assert ex.specs()[NAME].trace("written")["y"] == expected(model, prompt_len)  # the prefill wrote the prompt
    ex.view = NAME
    assert ex.shown()[-1] == NAME and ex.figures[NAME] in ex._panel.children
    ex.step()
    bar = ex.figures[NAME].data[0]  # the figure on screen follows the step
    assert list(bar.y) == expected(model, 1) and bar.type == "bar"
    ex.controls["lane"].value = "concat"
    assert list(ex.figures[NAME].data[0].y) == expected(model, 1)


def test_a_registered_view_is_in_every_replay_frame_and_page(model, toy_view, tmp_path):
    runs = {"preallocated": run(model, "preallocated", 4), "concat": run(model, "concat", 4)}
    all_frames, _ = frames(runs)
    for step, frame in enumerate(all_frames):
        assert {f"{NAME}:preallocated", f"{NAME}:concat"} <= set(frame["figures"])
        bar = frame["figures"][f"{NAME}:concat"]["data"][0]["y"]  # (a list of ints travels as it is)
        assert bar == expected(model, runs["concat"][step].input_len)
    page = save_html(runs, tmp_path / "replay.html").read_text()
    data = unpack(page)
    assert NAME in data["meta"]["views"]["lane"]  # the player makes a div.kvx-bytes-written per lane
    assert f"{NAME}:preallocated" in data["frames"][-1]["figures"]
    # a recorded history's own save_html (the trace layer's method) draws it too
    data = unpack(runs["concat"].save_html(tmp_path / "history.html").read_text())
    assert f"{NAME}:concat" in data["frames"][0]["figures"]


def test_a_registered_view_is_in_the_notebooks_static_copy(model, toy_view):
    ex = kvexplore.Explorer(model, strategies=("preallocated",), max_seq_len=48, prompt=PROMPT)
    ex.run(2)
    data = unpack(ex._static.html())
    assert NAME in data["meta"]["views"]["lane"]
    assert f"{NAME}:preallocated" in data["frames"][-1]["figures"]


def test_without_the_registration_nothing_draws_it(model, tmp_path):
    assert NAME not in VIEWS and NAME not in TABS
    ex = kvexplore.Explorer(model, strategies=("preallocated",), max_seq_len=48, prompt=PROMPT)
    assert NAME not in ex.figures and NAME not in ex.specs()
    data = unpack(ex._static.html())
    assert data["meta"]["views"] == {"lane": ["cache_map", "attention"], "run": ["memory"]}


def test_a_bad_view_is_refused_and_changes_nothing():
    before = dict(VIEWS)
    with pytest.raises(kvexplore.SettingsError, match="view 'cache_map' is built in and cannot be replaced"):
        register(View("cache_map", "Mine", bytes_written))
    with pytest.raises(kvexplore.SettingsError, match="lower-case"):
        register(View("Bytes Written", "Mine", bytes_written))
    with pytest.raises(kvexplore.SettingsError, match="replay="):
        register(View("mine", "Mine", bytes_written, replay="sometimes"))
    with pytest.raises(kvexplore.SettingsError,
                       match="view .attention. is built in; only a view registered later can be removed"):
        unregister("attention")
    assert VIEWS == before


@pytest.mark.browser
def test_the_replay_page_draws_a_registered_view_in_a_browser(model, toy_view, tmp_path, browser):
    """The player makes the registered view's figure in every lane's section and draws each step's bars."""
    runs = {"preallocated": run(model, "preallocated", 3), "concat": run(model, "concat", 3)}
    path = save_html(runs, tmp_path / "toy.html")
    page = browser.new_page()
    try:
        open_replay(page, path, [])
        for step in (0, 2):
            page.evaluate("(i) => document.querySelector('.kvx-replay').kvxShow(i)", step)
            page.wait_for_function(f"{ROOT}.dataset.kvxStep === '{step}'", timeout=30_000)
            for lane, records in runs.items():
                y = page.evaluate("""(lane) => Array.from(document.querySelector(
                    `section[data-lane="${lane}"] .kvx-bytes-written`).data[0].y)""", lane)
                assert y == expected(model, records[step].input_len), (lane, step)
    finally:
        page.close()
