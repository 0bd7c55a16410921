"""A run with lanes over several processes, exported as the HTML replay and opened from disk in headless Chromium with
the network blocked: at every step the Ranks figure the page draws (its ``gd.data``) is the one the views draw from
the records at that step, for the tp and the cp lane, and the one-process lane has none."""

from __future__ import annotations

import pytest

import kvexplore
from kvexplore.explorer.session import Session
from kvexplore.replay import save_html, snapshot_at
from kvexplore.views import ranks
from replay_support import open_replay, same, slide

pytestmark = pytest.mark.browser

STEPS = 6
READ = """(lane) => {
  const sec = document.querySelector(`section[data-lane="${lane}"]`);
  const fig = sec.querySelector('.kvx-ranks');
  if (!fig) return null;
  const plain = (v) => v == null ? v : (ArrayBuffer.isView(v) ? Array.from(v) : (Array.isArray(v) ? v.map(plain) : v));
  return fig.data.map((t) => ({name: t.name, type: t.type, x: plain(t.x), y: plain(t.y), z: plain(t.z)}));
}"""


def test_the_replay_draws_every_rank_from_the_records_at_every_step(tmp_path, browser):
    session = Session(kvexplore.load("tiny"), ("preallocated", "tp:2", "cp:2"), max_seq_len=64,
                      strategy_options={"cp:2": {"interleave": 4}})
    try:
        session.prefill("The whale swam under the ship")
        for _ in range(STEPS - 1):
            session.step()
    finally:
        session.close()
    runs = session.runs()
    path = save_html(runs, tmp_path / "ranks.html")
    requests: list[str] = []
    page = browser.new_page()
    try:
        page.set_viewport_size({"width": 1280, "height": 800})
        open_replay(page, path, requests)
        for step in range(STEPS):
            slide(page, step)
            assert page.evaluate(READ, "preallocated") is None
            for lane in ("tp:2", "cp:2"):
                want = ranks.from_snapshot(snapshot_at(runs, step, lane, 0, 0))
                got = page.evaluate(READ, lane)
                assert [(t["name"], t["type"]) for t in got] == [(t["name"], t["type"]) for t in want.traces]
                for g, w in zip(got, want.traces):
                    for key in ("x", "y", "z"):
                        if key in w:
                            assert same(g[key], w[key]), (lane, step, w["name"], key)
    finally:
        page.close()
    assert requests == []
