"""The compare, memory and attention views at a length where a scale to 1, a 3-line table head or lines drawn on top
of each other hide what they show: four lanes (exact, quantized, sink, evict) over a prompt that the sink and the
evict lanes cut, as in the app with a pasted chapter (issue 58)."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")
pytest.importorskip("ipywidgets")

import kvexplore  # noqa: E402
from kvexplore.views import attention, compare, memory  # noqa: E402
from kvexplore.views.spec import figure  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 6
LANES = ("preallocated", "quantized", "sink", "evict")
OPTIONS = {"quantized": {"bits": 4, "group_size": 8, "residual": 8}, "sink": {"sinks": 2, "window": 24},
           "evict": {"press": "knorm", "compression_ratio": 0.5}}


@pytest.fixture(scope="module")
def ex(trained):
    ex = kvexplore.Explorer(trained, strategies=LANES, max_seq_len=256, strategy_options=OPTIONS)
    ex.prefill(PROMPT)
    ex.run(4)
    return ex


# -- compare -------------------------------------------------------------------------------------------------------

def test_the_compare_table_has_one_line_heads_and_says_what_kl_is(ex):
    """Short heads that do not wrap (their full names, and what KL means, in their tooltips), a line under the
    table saying what KL is and what float rounding alone gives, and the lossy lanes' notes folded under one line
    that names them."""
    table = ex.controls["compare"].value
    heads = re.findall(r"<th[^>]*>([^<]*)</th>", table)
    assert heads == list(compare.HEADS) and max(map(len, heads)) <= 13
    style = re.search(r'<table class="kvx-compare-table" style="([^"]*)"', table).group(1)
    assert "white-space:nowrap" in table and "width" not in style  # as wide as its cells: no head squeezed
    kl_head = re.search(r'<th title="([^"]*)" class="kvx-explained">mean KL</th>', table)
    assert kl_head and "reference" in kl_head.group(1) and "1e-9" in kl_head.group(1) and "nats" in kl_head.group(1)
    line = table.split("</table>")[1]
    assert "float32 rounding alone: ~1e-9" in line and html.escape(compare.KL_MEANS) in line
    notes = re.search(r"<details[^>]*><summary[^>]*>what the lossy caches did: ([^<]*)</summary>", table)
    assert notes and notes.group(1) == "quantized, sink, evict"
    assert all(f"<li><b>{lane}</b>: " in table for lane in ("quantized", "sink", "evict"))
    assert ".kvx-compare-notes:not([open])>ul{display:none}" in table  # folded: not laid out where the figure is
    # the cells keep the rows' text as it is (the page's table is compared with the kernel's rows)
    rows = ex.compare_rows()
    cells = re.findall(r"<tr>((?:<td>[^<]*</td>)+)</tr>", table)
    assert [re.findall(r"<td>([^<]*)</td>", c) for c in cells] == [[html.escape(c) for c in r] for r in rows]


def test_the_compare_figure_fits_the_height_the_tab_leaves_it(ex):
    """One title line, no axis titles under the panels and the legend a row under the step ticks: the plot areas keep
    most of the 280 px the explorer leaves the figure under the table (the tab's 410 less 130)."""
    spec = compare.from_snapshot(ex.snapshot())
    layout = spec.layout
    assert layout["height"] == 280 and len(layout["title"]["text"]) < 50
    margin = layout["margin"]
    assert layout["height"] - margin["t"] - margin["b"] >= 0.65 * layout["height"]
    assert -0.2 < layout["legend"]["y"] < 0 and layout["legend"]["orientation"] == "h"
    figure(spec)  # plotly accepts every property


# -- memory --------------------------------------------------------------------------------------------------------

def _memory(ex):
    spec = ex.specs(["memory"])["memory"]
    return spec, {t["name"]: t for t in spec.traces}


def test_small_writes_are_drawn_on_a_log_axis(ex):
    """A decode step writes one token's keys and values, a prefill the prompt's: on a log axis both show; the panel's
    label says it is a log scale and its axis where 0 B went."""
    spec, by_name = _memory(ex)
    written = by_name["written · preallocated"]
    assert written["yaxis"] == "y2" and spec.layout["yaxis2"]["type"] == "log"
    assert "rangemode" not in spec.layout["yaxis2"] and spec.layout["yaxis"]["rangemode"] == "tozero"
    decode = [y for x, y in zip(written["x"], written["y"]) if x > 0]
    assert decode and min(decode) > 0 and written["y"][0] > 20 * max(decode)
    assert "(log)" in spec.layout["annotations"][1]["text"] and "0 B" in spec.layout["yaxis2"]["title"]["text"]


def test_lines_that_coincide_are_striped_and_named_in_the_legend(ex):
    """The analytic bytes of the lanes that hold the same tokens are one line: each lane's is wider than those drawn
    on it, so every colour shows, and the legend entry of each lane names what it shares with an earlier one and
    which of its own lines coincide."""
    spec, by_name = _memory(ex)
    same = [lane for lane in LANES if list(by_name[f"analytic · {lane}"]["y"]) ==
            list(by_name["analytic · preallocated"]["y"])]
    widths = [by_name[f"analytic · {lane}"]["line"]["width"] for lane in same]
    assert len(same) >= 2 and widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths)
    legend = [t["name"] for t in spec.traces if t.get("showlegend")]
    assert legend[0].startswith("preallocated (") and "logical = analytic" in legend[0]
    second = next(n for n in legend if n.startswith(same[1]))
    assert second.startswith(f"{same[1]} (= preallocated: ") and "analytic" in second
    figure(spec)


def _records(*figures):
    """Made-up records: per step ``(reserved, logical, analytic, written)`` bytes (held: reserved + 1)."""
    from kvexplore.caches.memory import MemoryReport
    from kvexplore.trace.records import StepRecord

    return [StepRecord(step=i, kind="decode" if i else "prefill", token_id=0, text="", position=i + 1, input_len=1,
                       cache_length=i + 1, prob=1.0,
                       memory=MemoryReport(length=i + 1, reserved_bytes=r, logical_bytes=lg, analytic_bytes=an,
                                           written_bytes=w, held_bytes=r + 1))
            for i, (r, lg, an, w) in enumerate(figures)]


def test_lines_that_meet_for_some_steps_are_striped_too():
    """A sink's logical bytes equal the full cache's until it evicts: where they meet, the one drawn first is wider.
    Lanes that never meet keep the plain width and their plain names; equal lanes name the earlier lane once."""
    full = _records((800, 100, 100, 100), (800, 110, 110, 10), (800, 120, 120, 10), (800, 130, 130, 10))
    sink = _records((400, 100, 100, 100), (400, 110, 110, 10), (400, 110, 110, 10), (400, 110, 110, 9))
    other = _records((900, 200, 300, 50), (900, 201, 301, 5), (900, 202, 302, 5), (900, 203, 303, 5))
    spec = memory.spec({"full": full, "sink": sink, "other": other, "twin": full})
    by_name = {t["name"]: t for t in spec.traces}
    assert [by_name[f"logical · {n}"]["line"]["width"] for n in ("full", "sink", "other", "twin")] == [8, 5, 2, 2]
    assert by_name["logical · full"]["hovertemplate"].count("same as twin") == 1
    assert "same as" not in by_name["logical · sink"]["hovertemplate"]
    legend = [t["name"] for t in spec.traces if t.get("showlegend")]
    assert legend == ["full (logical = analytic)", "sink (logical = analytic)", "other",
                      "twin (= full: held, reserved, logical, …)"]  # capped: the legend's line stays short


# -- attention -----------------------------------------------------------------------------------------------------

def test_the_history_colours_follow_the_cells_drawn(ex):
    """Its colour scale runs from 0 to the 99th percentile of the probabilities drawn (the first rows' p = 1 would
    leave the rest white), and the colour bar says so."""
    spec = ex.specs(["attention"])["attention"]
    heat = spec.trace("history")
    z = np.asarray(heat["z"], dtype=np.float64)
    assert heat["zmin"] == 0 and heat["zmax"] == pytest.approx(np.quantile(z, 0.99))
    assert z.max() == pytest.approx(1.0) and heat["zmax"] < 0.5  # row 0 reads one key; most read many
    assert "0 to p99" in heat["colorbar"]["title"]["text"]
    assert attention.colour_top(np.zeros(0, np.float32)) == 1.0 and attention.colour_top(np.zeros(4)) == 1.0
    figure(spec)


def test_the_title_names_the_token_fed_and_the_token_it_produced(ex):
    """The newest row is the pass of the token fed at position p; the token strip rings the token it produced."""
    spec = ex.specs(["attention"])["attention"]
    last = ex.lane.history[-1]
    texts = ex.snapshot().lane.detail.texts
    p = last.position - 1
    assert f"fed {p} {texts[p]!r} → produced {texts[p + 1]!r}" in spec.layout["title"]["text"].replace("<br>", "")
    assert texts[p + 1] == last.text


def test_after_a_reset_the_gqa_grid_is_not_drawn_without_its_axes(trained):
    """Nothing captured: every axis is hidden and the note says so; the grouping is not drawn on hidden axes."""
    ex = kvexplore.Explorer(trained, strategies=("preallocated",), max_seq_len=64)
    ex.prefill("Call me Ishmael.")
    ex.step()
    drawn = ex.specs(["attention"])["attention"]
    assert len(drawn.trace("gqa")["z"]) == trained.config.num_kv_heads
    ex.reset()
    spec = ex.specs(["attention"])["attention"]
    assert len(spec.trace("gqa")["z"]) == 0
    assert spec.layout["xaxis3"]["visible"] is False and spec.layout["yaxis3"]["visible"] is False
    assert [a["text"] for a in spec.layout["annotations"]] == ["no attention captured yet"]
