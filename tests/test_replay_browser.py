"""The exported replay in headless Chromium, opened from disk with the network blocked: the slider moves through
every step and what the page draws (each plotly figure's ``gd.data``, the token strip) is the recorded run's."""

from __future__ import annotations

import html as html_lib

import numpy as np
import pytest

import kvexplore
from browser_support import CHROMIUM, CHROMIUM_ARGS, require_browser
from kvexplore.explorer.views import cache_map
from kvexplore.replay import save_html, snapshot_at

pytestmark = pytest.mark.slow

STEPS, LAYER, HEAD = 20, 3, 5
READ = """(lane) => {
  const sec = document.querySelector(`section[data-lane="${lane}"]`);
  const plain = (v) => v == null ? v : (ArrayBuffer.isView(v) ? Array.from(v) : (Array.isArray(v) ? v.map(plain) : v));
  const traces = (el) => el.data.map((t) => ({name: t.name, x: plain(t.x), y: plain(t.y), z: plain(t.z)}));
  const last = sec.querySelector('.kvx-strip .kvx-last');
  return {cache: traces(sec.querySelector('.kvx-cache-map')), attention: traces(sec.querySelector('.kvx-attention')),
          generated: sec.querySelectorAll('.kvx-strip .kvx-gen').length, last: last ? last.textContent : null,
          title: sec.querySelector('.kvx-cache-map').layout.title.text};
}"""


def same(a, b) -> bool:
    a = np.asarray([np.nan if v is None else v for v in np.asarray(a, dtype=object).ravel()], dtype=float)
    b = np.asarray(b, dtype=float).ravel()
    return a.shape == b.shape and np.allclose(a, b, equal_nan=True, atol=1e-6)


def test_replay_from_disk_moves_through_every_step_and_draws_the_trace(tmp_path):
    require_browser()
    from playwright.sync_api import sync_playwright

    model = kvexplore.load("tiny")
    runs = {}
    for kind, options in (("preallocated", {}), ("concat", {}), ("paged", {"block_size": 8})):
        g = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=64, **options),
                                tracer=kvexplore.Tracer(capture={"cache", "attention", "memory"}))
        g.prefill("Call me Ishmael. Some years ago")
        g.run(STEPS - 1, stop_at_eos=False)
        runs[kind] = g.history
    path = save_html(runs, tmp_path / "replay.html", layer=LAYER, head=HEAD)

    requests = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})

            def route(r):
                if not r.request.url.startswith("file:"):
                    requests.append(r.request.url)
                    return r.abort()
                return r.continue_()

            page.route("**/*", route)
            page.goto(path.as_uri())
            page.wait_for_function("document.body.dataset.kvxReady === '1' || !!document.body.dataset.kvxError",
                                   timeout=120_000)
            assert page.evaluate("document.body.dataset.kvxError") is None
            assert page.evaluate("document.getElementById('kvx-slider').max") == str(STEPS - 1)
            for step in range(STEPS):
                page.evaluate("(i) => { const s = document.getElementById('kvx-slider'); s.value = String(i); "
                              "s.dispatchEvent(new Event('input')); }", step)
                page.wait_for_function(f"document.body.dataset.kvxStep === '{step}'", timeout=30_000)
                for lane, run in runs.items():
                    got = page.evaluate(READ, lane)
                    record = run[step]
                    # the strip: the prompt, then one token per step so far, the newest outlined
                    assert got["generated"] == step + 1
                    shown = record.text.replace(" ", "·").replace("\t", "→").replace("\n", "↵\n") or "∅"
                    assert got["last"] == html_lib.unescape(shown)
                    # the attention bar: the recorded probabilities of this step, in physical slot order
                    bar = next(t for t in got["attention"] if t["name"] == "current")
                    want = record.trace.physical_attention(LAYER)[-1, record.trace.heads.index(HEAD)]
                    assert same(bar["y"], want.numpy()), (lane, step)
                    # the cache map: the classes of this step's slots, from its recorded slot views
                    spec = cache_map.from_snapshot(snapshot_at(runs, step, lane, LAYER, HEAD), lane)
                    assert got["title"] == spec.layout["title"]["text"]
                    drawn = {t["name"]: t for t in got["cache"]}
                    for t in spec.traces:
                        if t.get("type") == "heatmap":
                            assert same(drawn[t["name"]]["z"], t["z"]), (lane, step, t["name"])
            page.screenshot(path=str(tmp_path / "replay.png"))
        finally:
            browser.close()
    assert requests == []  # nothing but the file itself
