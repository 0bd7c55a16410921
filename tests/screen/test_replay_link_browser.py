"""A link into the HTML replay, as the app's link reads (``#step=5&layer=3&head=1&tab=attention``), in headless
Chromium with the page opened from disk and the network blocked: the page opens at that step and (layer, head) pick,
every plotly figure's ``gd.data`` is what the views draw for that step and pick, the attention figure is scrolled
into view below the controls and outlined; the address follows the slider, the pick selector and a click on a
figure; a link to a pick, tab or step the file lacks opens the nearest view with a one-line notice saying what the
file holds and how to save it with that pick. One browser, four loads of the page."""

from __future__ import annotations

import dataclasses
import json

import pytest

import kvexplore
from browser_support import screenshot
from browser_truth import mismatches
from kvexplore.explorer.inspect import plain
from kvexplore.replay import save_html, snapshot_at
from kvexplore.views.registry import replayed
from browser_truth import PLAIN
from replay_support import ROOT, slide

pytestmark = pytest.mark.browser

STEPS = 10
# every figure of the replay by its frame key (<view>:<lane>, or <view> for a view of the whole run), as plain lists
READ = """() => {""" + PLAIN + """
  const out = {};
  for (const gd of document.querySelectorAll('.kvx-replay .kvx-fig')) {
    const lane = gd.closest('section');
    out[gd.dataset.view + (lane ? ':' + lane.dataset.lane : '')] = {data: plain(gd.data), layout: plain(gd.layout)};
  }
  return JSON.stringify(out);
}"""
STATE = f"""() => {{ const r = {ROOT}, n = r.querySelector('.kvx-notice'), a = r.querySelector('.kvx-attention');
  const box = a.getBoundingClientRect(), bar = r.querySelector('.kvx-controls').getBoundingClientRect();
  const sel = r.querySelector('.kvx-pick');
  return {{step: r.dataset.kvxStep, pick: r.dataset.kvxPick, hash: location.hash, select: sel ? sel.value : null,
          notice: n.textContent, noticeShown: n.offsetHeight > 0, top: box.top, below: bar.bottom,
          height: innerHeight, scrolled: scrollY,
          marked: [...r.querySelectorAll('.kvx-marked')].map((d) => d.dataset.view),
          outline: getComputedStyle(a).outlineStyle}}; }}"""


def kernel(runs, step: int, layer: int, head: int) -> dict:
    """What the views draw for ``step`` at ``(layer, head)``, by the replay's frame keys."""
    per_lane, per_run = replayed(runs)
    snap = snapshot_at(runs, step, next(iter(runs)), layer, head)
    specs = {}
    for lane in runs:
        for view in per_lane:
            specs[f"{view.name}:{lane}"] = view.build(dataclasses.replace(snap, shown=lane))
    for view in per_run:
        specs[view.name] = view.build(dataclasses.replace(snap, shown=list(runs)[-1]))
    return {key: {"traces": plain(s.traces), "layout": plain(s.layout)} for key, s in specs.items()}


def agree(page, runs, step: int, layer: int, head: int) -> None:
    specs = kernel(runs, step, layer, head)
    diff = mismatches({"specs": specs}, {"figures": json.loads(page.evaluate(READ))}, list(specs))
    assert not diff, f"step {step}, layer {layer} head {head}:\n  " + "\n  ".join(diff[:20])


def reopen(page, path, link: str) -> dict:
    """Open ``path#link`` (a new load: a change of the hash alone does not reload the page), wait until it has drawn
    (it must report no error) and read its state."""
    page.goto("about:blank")
    page.goto(path.as_uri() + "#" + link)
    page.wait_for_function(f"{ROOT}.dataset.kvxReady === '1' || !!{ROOT}.dataset.kvxError", timeout=120_000)
    assert page.evaluate(f"{ROOT}.dataset.kvxError") is None
    return page.evaluate(STATE)


def test_a_link_opens_its_step_pick_and_tab_and_the_address_follows(tmp_path, browser, shots, trained):
    runs = {}
    for kind in ("preallocated", "paged"):
        g = kvexplore.Generator(trained, kvexplore.make_cache(kind, trained, max_seq_len=64),
                                tracer=kvexplore.Tracer(capture={"cache", "attention", "memory"}))
        g.prefill("Call me Ishmael. Some years ago")
        g.run(STEPS - 1, stop_at_eos=False)
        runs[kind] = g.history
    two = save_html(runs, tmp_path / "two.html", layer=0, head=0, picks=[(3, 1)])
    one = save_html(runs, tmp_path / "one.html", layer=0, head=0)
    requests: list[str] = []
    page = browser.new_page()
    try:
        page.set_viewport_size({"width": 1280, "height": 800})
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "about:"))
                   else (requests.append(r.request.url), r.abort()))
        # the link's step, pick and tab: the figures are that pick's, the attention brought into view and outlined
        state = reopen(page, two, "step=5&layer=3&head=1&tab=attention")
        assert (state["step"], state["pick"], state["select"]) == ("5", "3,1", "1")
        assert state["hash"] == "#step=5&layer=3&head=1&tab=attention"
        assert not state["noticeShown"]
        agree(page, runs, 5, 3, 1)
        assert state["scrolled"] > 0 and state["below"] - 1 <= state["top"] < state["height"] / 2, state
        assert state["marked"] == ["attention", "attention"] and state["outline"] == "solid"  # one per lane
        screenshot(page, shots / "replay_link_1280x800_attention.png")
        # the slider, the pick selector and a click on a figure rewrite the address
        slide(page, 7)
        assert page.evaluate("location.hash") == "#step=7&layer=3&head=1&tab=attention"
        agree(page, runs, 7, 3, 1)
        page.select_option(".kvx-pick", "0")
        page.wait_for_function(f"{ROOT}.dataset.kvxPick === '0,0'")
        assert page.evaluate("location.hash") == "#step=7&layer=0&head=0&tab=attention"
        agree(page, runs, 7, 0, 0)
        page.locator(".kvx-memory").click()
        assert page.evaluate("location.hash") == "#step=7&layer=0&head=0&tab=memory"
        assert page.evaluate(STATE)["marked"] == ["memory"]
        page.evaluate("scrollTo(0, 0)")
        screenshot(page, shots / "replay_link_1280x800_top.png")
        # a pick and a tab the file lacks: the nearest view, and a notice naming what the file holds
        state = reopen(page, two, "step=2&layer=5&head=2&tab=tensors")
        assert (state["step"], state["pick"]) == ("2", "0,0") and state["noticeShown"]
        assert "layer 5 head 2 is not in this file, showing layer 0 head 0: this replay holds layer 0 head 0, " \
               "layer 3 head 1; save it with picks=[(5, 2)]" in state["notice"]
        assert "this replay has no tensors figure" in state["notice"]
        assert state["hash"] == "#step=2&layer=0&head=0"  # the link to what is shown
        agree(page, runs, 2, 0, 0)
        screenshot(page, shots / "replay_link_1280x800_notice.png")
        # one pick only, and garbage: no selector, no exception, the run as it ended
        state = reopen(page, one, "step=abc&layer=3&head=1&tab=%3Cb%3E")
        assert (state["step"], state["pick"], state["select"]) == (str(STEPS - 1), "0,0", None)
        assert "this replay holds layer 0 head 0 only; save it with picks=[(3, 1)]" in state["notice"]
        assert "step=abc is not a step" in state["notice"] and "tab=<b> is not a view" in state["notice"]
        assert page.locator(".kvx-notice b").count() == 0  # the link's text is shown as text
        state = reopen(page, one, "layer=-1&head=99")
        assert state["pick"] == "0,0" and "layer=-1 is not a layer number" in state["notice"]
        assert "the model has no layer 0 head 99" in state["notice"]
    finally:
        page.close()
    assert requests == []
