"""The prefix cache's views from frames worked out by hand (tests/support/prefix_hand.py): the block pool's cells and
hovers, the tree's edges and unreachable nodes, the timeline's bars, the story, the widget's slider and listeners, the
HTML replay's data, and the errors for bad input."""

from __future__ import annotations

import base64
import gzip
import json
import re

import numpy as np
import pytest

import kvexplore
from kvexplore.errors import SettingsError
from kvexplore.explorer.inspect import plain
from kvexplore.prefix.frames import STATES
from kvexplore.replay import save_prefix_html
from kvexplore.views import prefix, prefix_pool, prefix_timeline, prefix_tree
from kvexplore.views.prefix_words import explain
from kvexplore.views.spec import figure, grid

import prefix_hand

FRAMES = prefix_hand.frames()


def _cells(spec) -> dict[int, tuple[str, str]]:
    """slot -> (state, hover) of the pool figure's heatmap."""
    heat = spec.trace("blocks")
    cols = prefix_pool.grid_columns(len(FRAMES[0].blocks))
    return {int(y) * cols + int(x): (STATES[int(z)], t) for x, y, z, t in zip(heat["x"], heat["y"], heat["z"],
                                                                               heat["text"])}


def test_pool_cells_are_coloured_by_each_blocks_state_and_hover_its_tokens():
    for frame in FRAMES:
        cells = _cells(prefix_pool.spec(frame))
        assert {s: state for s, (state, _) in cells.items()} == {b.slot: b.state for b in frame.blocks}
    cells = _cells(prefix_pool.spec(FRAMES[2]))
    state, hover = cells[0]
    assert state == "hit"
    assert "“w1·w2·w3·w4·”" in hover and "ids [1, 2, 3, 4]" in hover and "hash aa01" in hover
    assert "refcount 1 · stored by request 1 · last used by request 2" in hover
    assert "parent aa01" in cells[3][1] and "“w5·w6·w20·w21·”" in cells[3][1]
    assert cells[7][0] == "free" and "free" in cells[7][1]


def test_pool_numbers_the_free_queue_and_marks_state_checkpoints():
    spec = prefix_pool.spec(FRAMES[3])
    cols = prefix_pool.grid_columns(8)
    nxt = spec.trace("next free")
    assert nxt["text"] == ["1", "2", "3", "4", "5"]
    assert [round(float(x) + 0.28) + cols * round(float(y) + 0.22) for x, y in zip(nxt["x"], nxt["y"])] == \
        list(FRAMES[3].free_queue)
    assert "cached: taking it drops its prefix" in nxt["hovertemplate"][3]  # slot 1 holds a cached prefix
    marks = spec.trace("state checkpoint")
    assert [(round(float(x) - 0.3), round(float(y) + 0.22)) for x, y in zip(marks["x"], marks["y"])] == \
        [prefix_pool.cell(7, cols)]
    assert "state checkpoint" in _cells(spec)[7][1]
    assert "unreachable" in _cells(spec)[1][1]  # its node's parent was evicted
    figure(spec)  # plotly accepts every property


def test_pool_of_4096_blocks_is_one_heatmap():
    frames = prefix_hand.synthetic(4096, 12)
    spec = prefix_pool.spec(frames[-1])
    assert len(spec.traces) <= 12
    assert grid(spec.trace("blocks")).size >= 4096 and len(spec.trace("blocks")["text"]) == 4096
    assert "labels" not in [t["name"] for t in spec.traces]  # no per-cell text at this size
    tree = prefix_tree.spec(frames[-1])
    assert len(tree.traces) <= 10 and len(frames[-1].tree) > 1000
    assert sum(len(t["x"]) for t in tree.traces if t["name"] in STATES) == len(frames[-1].tree)


def _segments(trace) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    """The edges trace as (start, end) points: each edge is start, elbow, end, gap."""
    x, y = np.asarray(trace["x"], dtype=float), np.asarray(trace["y"], dtype=float)
    return [((x[i], y[i]), (x[i + 2], y[i + 2])) for i in range(0, len(x), 4)]


def test_tree_edges_are_the_parents_and_nodes_sit_where_their_prefix_ends():
    frame = FRAMES[2]
    spec = prefix_tree.spec(frame)
    assert set(prefix_tree.edges(frame)) == {(None, "aa01"), ("aa01", "bb02"), ("aa01", "cc03")}
    rows = prefix_tree.layout_rows(frame)
    assert rows["bb02"] != rows["cc03"] and rows["aa01"] == (rows["bb02"] + rows["cc03"]) / 2  # tidy
    by_id = {n.id: n for n in frame.tree}
    root = (0.0, float(spec.trace("empty prefix")["y"][0]))
    where = {n: (float(prefix_tree.end(by_id[n])), rows[n]) for n in by_id}
    assert sorted(_segments(spec.trace("edges"))) == sorted((root if p is None else where[p], where[c])
                                                            for p, c in prefix_tree.edges(frame))
    assert list(spec.trace("hit")["x"]) == [4] and "w1·w2·w3·w4·" in spec.trace("hit")["hovertext"][0]
    assert "hits: 1 request served" in spec.trace("hit")["hovertext"][0]
    assert list(spec.trace("written")["x"]) == [8]
    assert list(spec.trace("unreachable")["x"]) == []


def test_tree_marks_the_blocks_whose_parent_was_evicted():
    spec = prefix_tree.spec(FRAMES[3])
    lost = spec.trace("unreachable")
    rows = prefix_tree.layout_rows(FRAMES[3])
    assert sorted(zip(lost["x"].tolist(), lost["y"].tolist())) == sorted([(8, rows["bb02"]), (8, rows["cc03"])])
    assert "2 unreachable" in spec.layout["title"]["text"]
    assert all("unreachable" in h for h in spec.trace("cached")["hovertext"])
    figure(spec)


def test_timeline_bars_are_each_requests_hit_recomputed_and_generated_tokens():
    spec = prefix_timeline.spec(FRAMES, 2)
    assert spec.trace("hit")["x"].tolist() == [1, 2, 3]
    assert spec.trace("hit")["y"].tolist() == [0, 4, 0]
    assert spec.trace("recomputed")["y"].tolist() == [10, 5, 12]
    assert spec.trace("generated")["y"].tolist() == [2, 1, 0]
    assert "diverged at token 6" in spec.trace("recomputed")["hovertext"][1]
    (box,) = spec.layout["shapes"]
    assert (box["x0"], box["x1"]) == (1.5, 2.5)
    assert "request 2: 4 hit, 5 recomputed, 1 generated" in spec.layout["title"]["text"]
    figure(spec)


def test_event_frames_draw_blocks_stored_and_removed_per_batch():
    frames = prefix_hand.events()
    spec = prefix_timeline.spec(frames, 2)
    assert spec.trace("stored")["y"].tolist() == [2, 1]
    assert spec.trace("removed")["y"].tolist() == [0, -1]
    assert "batch 2: 1 stored, 1 removed" in spec.layout["title"]["text"]
    pool = prefix_pool.spec(frames[2])
    assert "stored by batch 2" in _cells(pool)[2][1]
    assert prefix_tree.spec(frames[2]).trace("unreachable")["x"].tolist() == [8]
    for i in range(3):
        for s in prefix.figures(frames, i).values():
            figure(s)


def test_the_story_says_hits_bytes_and_each_misss_reason():
    lines = explain(FRAMES[2])
    assert "request 2: 9 prompt tokens: 4 hit, 5 recomputed, 1 generated" in lines
    assert "shared from the cache: 1.0 KiB (1 block)" in lines
    assert any("tokens 4–8 recomputed (diverged): diverged at token 6" in t for t in lines)
    assert "evicted slot 0 (aa01, least recently used) to make room" in explain(FRAMES[3])
    assert explain(FRAMES[0])[1] == "the empty pool: 8 blocks of 4 tokens, all free"
    assert "&#x27;w20 &#x27;" in prefix.story(FRAMES, 2)  # escaped for HTML


class FakePool:
    """What PrefixView asks of a pool: frames() and a listeners list."""

    def __init__(self, frames):
        self._frames, self.listeners = list(frames), []

    def frames(self):
        return list(self._frames)

    def serve(self, frame):
        self._frames.append(frame)
        for fn in list(self.listeners):
            fn(frame)


def test_widget_slider_moves_the_figures_and_the_story():
    view = kvexplore.PrefixView(FRAMES)
    assert (view.slider.min, view.slider.max, view.slider.value) == (0, 3, 3)
    before = view.figures["prefix_pool"].patch
    view.slider.value = 1
    for name, spec in prefix.figures(FRAMES, 1).items():
        drawn = view.figures[name].figure  # what the page draws: the base with the patch on it
        assert plain(drawn["data"]) == plain(spec.traces) and plain(drawn["layout"]) == plain(spec.layout), name
    assert view.figures["prefix_pool"].patch != before  # a patch went to the page, not a new figure
    assert view.figures["prefix_timeline"].spec.layout["shapes"][0]["x0"] == 0.5
    assert "request 1: 10 prompt tokens" in view.story.value and view.label.value == "frame 1/3 · request 1"
    view.show(2)
    assert view.slider.value == 2 and "diverged at token 6" in view.story.value


def test_widget_follows_a_pool_as_it_serves():
    pool = FakePool(FRAMES[:2])
    view = kvexplore.PrefixView(pool, frame=0)
    assert view.slider.max == 1 and view.slider.value == 0
    pool.serve(FRAMES[2])
    assert (view.slider.max, view.slider.value, view.play.max) == (2, 2, 2)
    assert view.figures["prefix_timeline"].spec.trace("hit")["y"].tolist() == [0, 4]
    pool.serve(FRAMES[3])
    assert view.slider.value == 3 and "evicted slot 0" in view.story.value
    view.close()
    assert pool.listeners == []


def test_bad_sources_and_frames_are_refused_with_the_fix():
    with pytest.raises(SettingsError, match="pass a PrefixPool"):
        kvexplore.PrefixView(42)
    with pytest.raises(SettingsError, match="item 1 is a dict, not a PoolFrame"):
        kvexplore.PrefixView([FRAMES[0], {}])
    with pytest.raises(SettingsError, match="no frames to draw"):
        kvexplore.PrefixView([])
    with pytest.raises(SettingsError, match=r"frame 9 does not exist: there are frames 0\.\.3"):
        kvexplore.PrefixView(FRAMES, frame=9)
    view = kvexplore.PrefixView(FRAMES)
    with pytest.raises(SettingsError, match="frame -1 does not exist"):
        view.show(-1)
    assert view.slider.value == 3
    with pytest.raises(SettingsError, match="pass a PrefixPool"):
        save_prefix_html("frames.json", "x.html")


def _unpacked(path) -> dict:
    text = path.read_text()
    packed = re.search(r'class="kvx-data">([^<]*)<', text).group(1)
    return json.loads(gzip.decompress(base64.b64decode(packed)))


def test_replay_page_carries_every_frames_figures_once(tmp_path):
    path = save_prefix_html(FRAMES, tmp_path / "prefix.html", title="three requests")
    text = path.read_text()
    assert "<title>three requests</title>" in text and 'class="kvx-plotly"' in text
    data = _unpacked(path)
    assert [f["label"] for f in data["frames"]] == ["frame 0/3 · empty pool", "frame 1/3 · request 1",
                                                  "frame 2/3 · request 2", "frame 3/3 · request 3"]
    arrays = [np.frombuffer(base64.b64decode(a["b64"]), dtype=a["dtype"]) for a in data["arrays"]]
    heat = data["frames"][2]["figures"]["prefix_pool"]["data"][0]
    hover = [data["strings"][i] for i in arrays[heat["text"]["$t"]["$a"]][: heat["text"]["$t"]["n"]]]
    assert hover == prefix_pool.spec(FRAMES[2]).trace("blocks")["text"]
    assert "diverged at token 6" in data["frames"][2]["story"]


@pytest.mark.long  # the fast tier's heaviest (1-3 s): a 50-request replay page
def test_replay_page_of_50_requests_on_512_blocks_stays_small(tmp_path):
    path = save_prefix_html(prefix_hand.synthetic(512, 50), tmp_path / "big.html")
    data = _unpacked(path)
    assert len(data["frames"]) == 51
    assert len(data["strings"]) < 51 * 512 / 3  # a block's hover travels once, not once per frame
    assert path.stat().st_size < 4_000_000  # plotly.js alone is about 2 MB of it


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_views_of_a_real_pool_show_its_own_state_and_follow_it(tiny, policy):
    pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=8, policy=policy)
    system = "You are a terse guide at the whale museum. "
    pool.serve(system + "Where is the whale?", max_new_tokens=3)
    view = kvexplore.PrefixView(pool)
    assert view.slider.max == 1
    r = pool.serve(system + "When does it open?", max_new_tokens=3)
    assert (view.slider.max, view.slider.value) == (2, 2)  # the listener grew the slider and moved it
    frame = pool.frames()[-1]
    cells = _cells(view.figures["prefix_pool"].spec)
    assert {s: state for s, (state, _) in cells.items()} == {b.slot: b.state for b in frame.blocks}
    for h, page in pool.hashes.items():  # the pool's own table: every cached block's hover names its hash
        assert f"hash {h}" in cells[page][1]
    hit = [s for s, (state, _) in cells.items() if state == "hit"]
    assert len(hit) * 8 == r.hit_tokens > 0
    bars = view.figures["prefix_timeline"].spec
    assert bars.trace("hit")["y"].tolist() == [0, r.hit_tokens]
    assert bars.trace("recomputed")["y"].tolist()[-1] == r.recomputed_tokens
    tree = view.figures["prefix_tree"].spec
    assert sum(len(t["x"]) for t in tree.traces if t["name"] in STATES) == len(pool.tree)
    assert set(prefix_tree.edges(frame)) == {(n.parent, n.id) for n in pool.tree}
    view.close()
    pool.serve(system + "Where is the shop?", max_new_tokens=3)
    assert view.slider.max == 2 and pool.listeners == []


def test_a_hybrid_pools_state_checkpoints_are_marked_and_its_misses_told(zoo):
    pool = kvexplore.PrefixPool(zoo.load("qwen3_next"), num_blocks=32, block_size=4, policy="hash",
                                checkpoint_states="ends")
    a = list(range(1, 15))
    pool.serve(a, response=[5])
    pool.serve(a[:10] + list(range(200, 206)), response=[5])  # shares 10 tokens: no state saved at 4 or 8
    frame = pool.frames()[-1]
    saved = sorted(b.slot for b in frame.blocks if b.state_checkpoint)
    assert saved  # the first request's state at its floor
    cols = prefix_pool.grid_columns(frame.num_blocks)
    marks = prefix_pool.spec(frame).trace("state checkpoint")
    assert sorted(round(float(x) - 0.3) + cols * round(float(y) + 0.22) for x, y in zip(marks["x"], marks["y"])) \
        == saved
    assert any("(no-state-checkpoint)" in line for line in explain(frame))
    assert "no-state-checkpoint" in prefix_timeline.spec(pool.frames(), 2).trace("recomputed")["hovertext"][-1]


def test_a_pool_saves_its_replay_through_the_registered_writer(tiny, tmp_path):
    pool = kvexplore.PrefixPool(tiny, num_blocks=8, block_size=4)
    pool.serve(list(range(1, 10)), response=[5])
    pool.serve(list(range(1, 10)), response=[5])
    path = pool.save_html(tmp_path / "pool.html", title="two requests")
    text = path.read_text()
    assert path.stat().st_size > 1_000_000 and "<title>two requests</title>" in text  # plotly.js inside
    assert text.count("kvx-prefix-") >= 2  # the replay's element and its player

def test_pools_side_by_side_move_under_one_slider_and_follow_their_pools(tiny):
    pools = [kvexplore.PrefixPool(tiny, num_blocks=6, block_size=4, policy="hash", reuse="fifo"),  # evicts (vLLM <0.32)
             kvexplore.PrefixPool(tiny, num_blocks=6, block_size=4, policy="radix")]
    for prompt in (list(range(1, 10)), list(range(100, 109)), list(range(200, 205))):
        kvexplore.PrefixPool.serve_each(pools, prompt, response=[5])
    both = kvexplore.PrefixCompare(pools)
    hashed, radix = both.views["hash"], both.views["radix"]
    assert (hashed.shown, radix.shown) == (3, 3)
    assert both.slider in both.widget.children[0].children and radix.slider not in radix.widget.children
    both.slider.value = 1
    assert (hashed.shown, radix.shown) == (1, 1)
    assert radix.story.value == kvexplore.views.prefix.story(pools[1].frames(), 1)
    # the same request again: hash hits 4 tokens (a block of it was evicted), radix 8 (see test_prefix.py)
    results = kvexplore.PrefixPool.serve_each(pools, list(range(1, 10)), response=[5])
    assert [r.hit_tokens for r in results] == [4, 8]
    assert (hashed.shown, radix.shown, both.slider.max) == (4, 4, 4)
    assert "4 from the cache" in hashed.story.value and "8 from the cache" in radix.story.value
    pools[0].serve(list(range(1, 10)), response=[5])  # only the first pool: the second stays at its last frame
    assert (hashed.shown, radix.shown) == (5, 4)
    both.show(2)
    assert (hashed.shown, radix.shown) == (2, 2)
    both.close()
    assert pools[0].listeners == [] and pools[1].listeners == []


def test_pools_side_by_side_refuse_what_cannot_be_compared(tiny):
    a = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=4)
    b = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=4, policy="radix")
    with pytest.raises(SettingsError, match="shows two or more pools side by side, got 1"):
        kvexplore.PrefixCompare([a])
    a.serve([1, 2, 3], response=[4])
    with pytest.raises(SettingsError, match=r"served different numbers of requests .*serve_each"):
        kvexplore.PrefixCompare({"hash": a, "radix": b})
    with pytest.raises(SettingsError, match="takes a list or a dict of pools"):
        kvexplore.PrefixCompare(a)


def test_a_side_by_side_page_holds_one_replay_per_pool_and_plotly_once(tiny, tmp_path):
    pools = {p: kvexplore.PrefixPool(tiny, num_blocks=6, block_size=4, policy=p) for p in ("hash", "radix")}
    kvexplore.PrefixPool.serve_each(list(pools.values()), list(range(1, 10)), response=[5])
    text = save_prefix_html(pools, tmp_path / "both.html").read_text()
    assert text.count('class="kvx-prefix-page"') == 2 and text.count('class="kvx-plotly"') == 1
    assert "<title>kvexplore · prefix cache</title>" in text and "hash and radix side by side" in text
    pools["hash"].serve([1, 2, 3], response=[4])
    with pytest.raises(SettingsError, match=r"two or more pools that served the same requests, got \{'hash': 3, "
                                            r"'radix': 2\}"):
        save_prefix_html(pools, tmp_path / "bad.html")
