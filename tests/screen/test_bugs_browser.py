"""``kvexplore bugs run NAME --html FILE`` in headless Chromium, opened from disk with the network blocked: the replay
draws the broken run beside its fixed twin, what each lane's cache map and token strip show at every step is the run's
records, and the first divergence is marked at its step."""

from __future__ import annotations

import html as html_lib

import pytest

import kvexplore.bugs as bugs
from replay_support import ROOT, open_replay, same, shown, slide
from kvexplore.cli.commands import main
from kvexplore.replay import snapshot_at
from kvexplore.views.bug_page import BROKEN, FIXED
from kvexplore.views import cache_map

pytestmark = pytest.mark.browser

READ = """(lane) => {
  const sec = document.querySelector(`section[data-lane="${lane}"]`);
  const plain = (v) => v == null ? v : (ArrayBuffer.isView(v) ? Array.from(v) : (Array.isArray(v) ? v.map(plain) : v));
  const last = sec.querySelector('.kvx-strip .kvx-last');
  return {cache: sec.querySelector('.kvx-cache-map').data.map((t) => ({name: t.name, z: plain(t.z)})),
          last: last ? last.textContent : null, mark: document.querySelector('.kvx-replay .kvx-mark').textContent};
}"""


@pytest.mark.parametrize("name", ["length-counted-early", "ring-rollback-after-wrap"])
def test_bugs_run_writes_a_replay_whose_page_is_the_two_runs(name, tmp_path, browser, capsys):
    path = tmp_path / f"{name}.html"
    assert main(["bugs", "run", name, "--html", str(path)]) == 0
    assert f"replay written to {path}" in capsys.readouterr().out
    r = bugs.reproduce(name)
    d = r.first_divergence
    runs = {BROKEN: r.broken.records(), FIXED: r.fixed.records()}
    layer = d.layer if d.layer is not None else 0
    steps = len(runs[BROKEN])
    requests = []
    page = browser.new_page()
    try:
        page.set_viewport_size({"width": 1280, "height": 800})
        open_replay(page, path, requests)
        assert page.evaluate(f"{ROOT}.querySelector('.kvx-slider').max") == str(steps - 1)
        for step in sorted({0, d.index, steps - 1}):
            slide(page, step)
            for lane, records in runs.items():
                got = page.evaluate(READ, lane)
                assert got["last"] == html_lib.unescape(shown(records[step])), (lane, step)
                spec = cache_map.from_snapshot(snapshot_at(runs, step, lane, layer, 0), lane)
                drawn = {t["name"]: t for t in got["cache"]}
                for t in spec.traces:
                    if t.get("type") == "heatmap":
                        assert same(drawn[t["name"]]["z"], t["z"]), (lane, step, t["name"])
            assert got["mark"] == (f"first divergence: {d}" if step == d.index else "")
    finally:
        page.close()
    assert requests == []
