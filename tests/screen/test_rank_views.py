"""The cache across processes drawn from what the ranks report: which KV heads (tensor parallel) or positions (context
parallel) each rank holds, and each rank's bytes; a long context drawn in at most MAX_COLUMNS columns."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvexplore
from kvexplore.distributed import Layout, Pass, Traffic, split
from kvexplore.views.ranks import MAX_COLUMNS, rank_bytes, rank_map, rank_traffic
from kvexplore.views.spec import figure


def _tp(tp: int, kv_heads: int = 2, heads: int = 8) -> list[dict]:
    config = dataclasses.replace(kvexplore.load("tiny").config, num_heads=heads, num_kv_heads=kv_heads)
    parts = [split(config, tp, r) for r in range(tp)]
    return [{"rank": p.rank, "kv_heads": list(p.kv_heads), "q_heads": list(p.q_heads), "model_kv_heads": kv_heads,
             "positions": None, "held_bytes": 1000 * len(p.kv_heads)} for p in parts]


def _cells(spec) -> np.ndarray:
    t = spec.trace("held")
    out = np.zeros((int(t["y"].max()) + 1, int(t["x"].max()) + 1))
    out[t["y"], t["x"]] = t["z"]
    return out


def test_tensor_parallel_ranks_hold_their_kv_heads_and_replicas_say_so():
    spec = rank_map(_tp(2))
    assert _cells(spec).tolist() == [[1, 0], [0, 1]]
    four = rank_map(_tp(4))
    assert _cells(four).tolist() == [[1, 0], [1, 0], [0, 1], [0, 1]]
    assert four.trace("held")["text"][0] == "KV head 0 on ranks 0, 1"
    figure(four)  # plotly takes every property


def test_context_parallel_ranks_hold_their_runs_and_a_long_context_is_binned():
    memory = [{"rank": r, "kv_heads": None, "positions": Layout(2, 16, r).positions(0, 70), "held_bytes": 1}
              for r in range(2)]
    cells = _cells(rank_map(memory))
    assert cells.shape == (2, 70) and cells.sum() == 70
    assert cells[0, :16].all() and not cells[1, :16].any() and cells[1, 16:32].all()
    long = [{"rank": r, "kv_heads": None, "positions": Layout(3, 1, r).positions(0, 6000), "held_bytes": 1}
            for r in range(3)]
    spec = rank_map(long)
    t = spec.trace("held")
    assert len(t["z"]) <= 3 * MAX_COLUMNS and t["x"].max() < 6000
    assert np.allclose(np.bincount(t["y"], weights=t["z"]) * 12, [2000, 2000, 2000])  # 12 positions a column
    figure(spec)


def test_bytes_per_rank_against_one_process_and_what_cannot_be_drawn_is_refused():
    spec = rank_bytes(_tp(2), whole=2000)
    assert spec.trace("held")["y"] == [1000, 1000] and spec.trace("one process")["y"] == [2000, 2000]
    figure(spec)
    with pytest.raises(kvexplore.SettingsError, match="a prefill and decode pair holds whole caches on each side"):
        rank_map([{"rank": 0, "kv_heads": None, "positions": None}])
    with pytest.raises(kvexplore.SettingsError, match="needs each rank's memory"):
        rank_map([])


def test_each_pass_splits_into_time_in_collectives_and_the_rest():
    steps = [Pass(20, 20, 0.050, [Traffic(12, 20 * 1024 * 12, 0.030), Traffic(12, 20 * 1024 * 12, 0.020)]),
             Pass(20 + 20, 1, 0.010, [Traffic(12, 1024 * 12, 0.004), Traffic(12, 1024 * 12, 0.006)])]
    spec = rank_traffic(steps)
    assert spec.trace("rank 0 in collectives")["y"] == pytest.approx([30.0, 4.0])
    assert spec.trace("the rest of the pass")["y"] == pytest.approx([20.0, 6.0])
    assert [d[2] for d in spec.trace("rank 0 in collectives")["customdata"]] == [245760, 12288]
    assert spec.trace("rank 0 in collectives")["x"] == [0, 1]  # one bar a pass, in order (positions in the hover)
    assert [d[:2] for d in spec.trace("the rest of the pass")["customdata"]] == [[20, 20], [40, 1]]
    assert [s.collective_share for s in steps] == pytest.approx([0.6, 0.6])
    assert "range" not in spec.layout["yaxis"] and not spec.layout["annotations"]  # the prompt's pass is 5x: drawn
    figure(spec)


def test_a_long_prompt_pass_is_cut_so_that_the_decode_passes_stay_readable():
    """At a chapter's length the prompt's pass takes seconds and a decode pass a fraction of one: the axis stops at
    twice the longest decode pass, and the prompt's bar says its time above the cut."""
    long = Pass(0, 4296, 19.5, [Traffic(60, 0, 12.0), Traffic(60, 0, 12.0)])
    steps = [long] + [Pass(4296 + i, 1, 0.4 + 0.05 * i, [Traffic(60, 0, 0.3)] * 2) for i in range(3)]
    spec = rank_traffic(steps)
    assert spec.layout["yaxis"]["range"] == pytest.approx([0, 2 * 500.0])
    assert [(n["x"], n["text"]) for n in spec.layout["annotations"]] == [(0, "19.5 s")]
    spec = rank_traffic(steps, last=2)  # the window keeps the passes' numbers; no prompt pass in it, nothing cut
    assert spec.trace("rank 0 in collectives")["x"] == [2, 3] and "range" not in spec.layout["yaxis"]
    figure(spec)
