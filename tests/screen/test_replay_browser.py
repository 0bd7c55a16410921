"""The exported replay in headless Chromium, opened from disk with the network blocked: the slider moves through
every step and what the page draws (each plotly figure's ``gd.data``, the token strip) is the recorded run's."""

from __future__ import annotations

import html as html_lib

import pytest

import kvexplore
from browser_support import require_browser, screenshot
from replay_support import ROOT, open_replay, same, shown, slide
from kvexplore.views import cache_map
from kvexplore.replay import save_html, snapshot_at

pytestmark = pytest.mark.browser

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


def test_replay_from_disk_moves_through_every_step_and_draws_the_trace(tmp_path, browser, trained):
    model = trained
    runs = {}
    for kind, options in (("preallocated", {}), ("concat", {}), ("paged", {"block_size": 8})):
        g = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=64, **options),
                                tracer=kvexplore.Tracer(capture={"cache", "attention", "memory"}))
        g.prefill("Call me Ishmael. Some years ago")
        g.run(STEPS - 1, stop_at_eos=False)
        runs[kind] = g.history
    path = save_html(runs, tmp_path / "replay.html", layer=LAYER, head=HEAD)

    requests = []
    page = browser.new_page()
    try:
        page.set_viewport_size({"width": 1400, "height": 1000})

        open_replay(page, path, requests)
        assert page.evaluate(f"{ROOT}.querySelector('.kvx-slider').max") == str(STEPS - 1)
        for step in range(STEPS):
            slide(page, step)
            for lane, run in runs.items():
                got = page.evaluate(READ, lane)
                record = run[step]
                # the strip: the prompt, then one token per step so far, the newest outlined
                assert got["generated"] == step + 1
                assert got["last"] == html_lib.unescape(shown(record))
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
        screenshot(page, tmp_path / "replay.png")
    finally:
        page.close()
    assert requests == []  # nothing but the file itself


@pytest.mark.notebooks
@pytest.mark.smollm2
def test_an_executed_tour_exported_with_nbconvert_shows_the_figures(tmp_path, browser, executed_notebook):
    """nbconvert of 01_tour.ipynb after execution (the run's executed copy, shared with test_notebooks.py): each
    explorer's static copy replays the run, offline."""
    require_browser("nbformat", "nbclient", "nbconvert")
    import json
    from pathlib import Path

    import nbformat
    from nbconvert import HTMLExporter

    source = Path(__file__).resolve().parents[2] / "notebooks" / "01_tour.ipynb"
    copy, run = executed_notebook(source)
    assert run["error"] is None, run["error"]
    nb = nbformat.read(copy, as_version=4)
    size = len(nbformat.writes(nb).encode())
    assert size < 4 * 2**20, f"the executed notebook is {size / 2**20:.1f} MiB"  # small enough to commit
    copies = [o for c in nb.cells for o in c.get("outputs", [])
              if "kvx-static" in o.get("data", {}).get("text/html", "")]
    assert len(copies) == 3  # one per explorer shown (the tiny one, the tiny one that forks, SmolLM2)
    body, _ = HTMLExporter().from_notebook_node(nb)
    page_path = tmp_path / "tour.html"
    page_path.write_text(body, encoding="utf-8")
    page = browser.new_page()
    try:
        page.set_viewport_size({"width": 1300, "height": 1000})
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
        page.goto(page_path.as_uri())
        done = "[...document.querySelectorAll('.kvx-replay')].every(r => r.dataset.kvxReady || r.dataset.kvxError)"
        page.wait_for_function(done, timeout=120_000)
        replays = page.evaluate("""[...document.querySelectorAll('.kvx-replay')].map((r) => ({
            error: r.dataset.kvxError || null, steps: Number(r.querySelector('.kvx-slider').max) + 1,
            lanes: [...r.querySelectorAll('section')].map((s) => s.dataset.lane),
            cells: [...r.querySelectorAll('.kvx-cache-map')].map((d) => d.data.length)}))""")
    finally:
        page.close()
    assert len(replays) == 3 and all(r["error"] is None for r in replays), json.dumps(replays)
    tour = replays[0]
    assert tour["lanes"][:3] == ["preallocated", "concat", "paged"] and tour["steps"] >= 7
    assert all(n > 0 for n in tour["cells"])  # every lane's cache map is drawn
