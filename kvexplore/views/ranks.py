"""The cache across processes, drawn from what each rank reports (``Ranks.memory()``, :mod:`kvexplore.distributed`):
:func:`rank_map`, which KV heads (tensor parallel) or positions (context parallel) each rank holds, one row per rank;
:func:`rank_bytes`, each rank's bytes against one process's cache; :func:`rank_traffic`, each pass's time in
collectives and the rest (``Ranks.steps``). :func:`from_snapshot` is the explorer's and the replay's Ranks view of a
``tp:N`` or ``cp:N`` lane: the three stacked, from the records (each step's trace keeps every rank's part,
:class:`~kvexplore.trace.ranks.RankStep`). Long contexts are drawn in at most :data:`MAX_COLUMNS` columns (each the
share of a run of positions a rank holds) and long runs' traffic as their last passes, so what the figure carries
follows the screen, not the context."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..caches.memory import format_bytes
from ..errors import SettingsError
from ..trace.records import StepRecord
from .spec import FigureSpec, columns, hide_axes

MAX_COLUMNS = 512
HELD = "#1f77b4"


def rank_map(memory: Sequence[dict[str, Any]], title: str | None = None) -> FigureSpec:
    """One row per rank, one column per KV head (tensor parallel) or per position or run of positions (context
    parallel): 1 where the rank holds it (a share, for a run), 0 where it does not."""
    if not memory:
        raise SettingsError("rank_map needs each rank's memory (ranks.memory())")
    if memory[0].get("kv_heads") is not None:
        width = memory[0]["model_kv_heads"]
        held = np.zeros((len(memory), width), dtype=np.float32)
        for m in memory:
            held[m["rank"], m["kv_heads"]] = 1.0
        x_title, unit = "KV head", 1
        text = [[_head_note(memory, r, h) for h in range(width)] for r in range(len(memory))]
    elif memory[0].get("positions") is not None:
        length = max([p + 1 for m in memory for p in m["positions"]], default=0)
        unit = max(1, math.ceil(length / MAX_COLUMNS))
        width = math.ceil(length / unit) if length else 0
        held = np.zeros((len(memory), width), dtype=np.float32)
        for m in memory:
            if m["positions"]:
                np.add.at(held[m["rank"]], np.asarray(m["positions"]) // unit, 1.0 / unit)
        x_title = "position" if unit == 1 else f"positions, {unit} a column"
        text = None
    else:
        raise SettingsError("rank_map draws tensor- or context-parallel ranks (their memory names KV heads or "
                            "positions); a prefill and decode pair holds whole caches on each side")
    cells = columns(held, x0=0)
    trace = {"type": "heatmap", "name": "held", **cells, "zmin": 0, "zmax": 1, "xgap": 1, "ygap": 2,
             "colorscale": [[0, "#f0f0f0"], [1, HELD]], "showscale": False,
             "hovertemplate": "rank %{y} · position %{x}<br>held: %{z:.0%}<extra></extra>"}
    if text:  # each head's holders (a replicated head on several ranks)
        trace["text"] = [t for row in text for t in row]
        trace["hovertemplate"] = "rank %{y} · %{text}<br>held: %{z:.0%}<extra></extra>"
    if unit > 1:
        trace["x"] = trace["x"] * unit  # each column at the first position of its run
    what = "KV heads" if text else "positions"
    xaxis = {"title": {"text": x_title}, **({"dtick": 1} if text else {})}
    yaxis = {"title": {"text": "rank"}, "autorange": "reversed", "dtick": 1}
    return FigureSpec([trace], {"title": {"text": title or f"which {what} each rank holds", "font": {"size": 13.0},
                                          "x": 0.01},
                                "xaxis": xaxis, "yaxis": yaxis, "height": 120 + 40 * len(memory),
                                "margin": {"l": 50, "r": 10, "t": 40, "b": 40}})


def _head_note(memory: Sequence[dict[str, Any]], rank: int, head: int) -> str:
    holders = [m["rank"] for m in memory if head in m["kv_heads"]]
    return f"KV head {head} on rank{'s' if len(holders) > 1 else ''} {', '.join(map(str, holders))}"


def rank_bytes(memory: Sequence[dict[str, Any]], whole: int | None = None) -> FigureSpec:
    """Each rank's bytes held (its report's), and ``whole``, one process's cache, as the line they share."""
    ranks = [f"rank {m['rank']}" for m in memory]
    held = [int(m["held_bytes"]) for m in memory]
    traces = [{"type": "bar", "name": "held", "x": ranks, "y": held, "marker": {"color": HELD},
               "hovertemplate": "%{x}: %{y:,} bytes<extra></extra>"}]
    if whole is not None:
        traces.append({"type": "scatter", "name": "one process", "x": ranks, "y": [whole] * len(ranks),
                       "mode": "lines", "line": {"color": "#d62728", "dash": "dash"},
                       "hovertemplate": f"one process's cache: {whole:,} bytes<extra></extra>"})
    return FigureSpec(traces, {"title": {"text": "bytes each rank holds", "font": {"size": 13.0}, "x": 0.01},
                               "yaxis": {"title": {"text": "bytes"}}, "height": 260,
                               "margin": {"l": 60, "r": 10, "t": 40, "b": 40}})


def rank_traffic(steps: Sequence[Any], rank: int = 0, last: int | None = None) -> FigureSpec:
    """Each pass's time (``ranks.steps``), one bar a pass in order (the prompt's first): the seconds rank ``rank``
    spent in its collectives and the rest, stacked, with the pass's position and the bytes its collectives carried in
    the hover; with ``last``, only the last that many passes. A prompt's pass over ten times the longest decode pass
    is cut at twice the longest of them and says its time above it, so that the decode passes stay readable."""
    shown = list(steps)[-last:] if last else list(steps)
    title = "each pass: time in collectives and the rest" + (
        f" (the last {len(shown):,} of {len(steps):,})" if len(shown) < len(steps) else "")
    first = len(steps) - len(shown)
    steps = shown
    x = list(range(first, first + len(steps)))
    inside = [s.traffic[rank].seconds * 1e3 for s in steps]
    rest = [max(0.0, s.seconds * 1e3 - c) for s, c in zip(steps, inside)]
    data = [[s.position, s.tokens, s.traffic[rank].bytes] for s in steps]
    hover = ("pass %{x} (position %{customdata[0]:,}, %{customdata[1]:,} tokens): %{y:.1f} ms<br>"
             "%{customdata[2]:,} bytes in collectives<extra></extra>")
    yaxis: dict[str, Any] = {"title": {"text": "ms"}}
    notes = []
    totals = [a + b for a, b in zip(inside, rest)]
    decode = [t for s, t in zip(steps, totals) if s.tokens == 1]
    if decode and max(totals) > 10 * max(decode):
        top = 2 * max(decode)
        yaxis["range"] = [0, top]
        notes = [{"text": f"{t / 1e3:.1f} s" if t >= 1e3 else f"{t:.0f} ms", "x": i, "y": top, "yanchor": "top",
                  "showarrow": False, "font": {"size": 12.0}} for i, t in zip(x, totals) if t > top]
    return FigureSpec([
        {"type": "bar", "name": f"rank {rank} in collectives", "x": x, "y": inside, "customdata": data,
         "marker": {"color": "#d62728"}, "hovertemplate": hover},
        {"type": "bar", "name": "the rest of the pass", "x": x, "y": rest, "customdata": data,
         "marker": {"color": HELD}, "hovertemplate": hover}],
        {"barmode": "stack", "title": {"text": title, "font": {"size": 13.0}, "x": 0.01}, "annotations": notes,
         "xaxis": {"title": {"text": "pass"}}, "yaxis": yaxis, "height": 280,
         "margin": {"l": 60, "r": 10, "t": 40, "b": 40}})


def passes(records: Sequence[StepRecord]) -> list[Any]:
    """Every rank's part of each step of a lane over several processes (:class:`~kvexplore.trace.ranks.RankStep`),
    in step order; empty for any other lane. The records of one verification share a trace: each pass once."""
    out: list[Any] = []
    for r in records:
        ranks = r.trace.ranks if r.trace is not None else None
        if ranks is not None and (not out or out[-1] is not ranks):
            out.append(ranks)
    return out


def distributed(records: Sequence[StepRecord]) -> bool:
    """Whether a lane's records come from several processes (the Ranks view applies to it)."""
    return bool(records) and records[0].trace is not None and records[0].trace.ranks is not None


def from_snapshot(snap: Any) -> FigureSpec:
    """The Ranks view of the lane shown, in one figure: which heads or positions each rank holds (left) and each
    rank's bytes against one process's cache (right, the dashed line), one row per rank; under them each pass's
    time, rank 0's collectives and the rest."""
    lane = snap.lane
    steps = passes(lane.history)
    if not steps:
        return FigureSpec([], hide_axes({"title": {"text": f"{lane.name} runs in one process: the Ranks view draws "
                                                           f"a tp:N or cp:N lane", "font": {"size": 13.0}},
                                         "xaxis": {}, "yaxis": {}, "height": 120}))
    now = steps[-1]
    memory = now.memory()
    held, sizes, traffic = rank_map(memory), rank_bytes(memory, now.whole_bytes), rank_traffic(steps, 0, snap.max_bins)
    n = len(memory)
    rows = {"autorange": "reversed", "range": None, "tickvals": list(range(n)), "ticktext": [f"rank {r}" for r in
                                                                                            range(n)]}
    traces = [{**t, "xaxis": "x", "yaxis": "y"} for t in held.traces]
    bars = sizes.traces[0]
    traces.append({**bars, "x": bars["y"], "y": list(range(n)), "orientation": "h", "xaxis": "x2", "yaxis": "y2",
                   "hovertemplate": "rank %{y}: %{x:,} bytes<extra></extra>"})
    traces.append({"type": "scatter", "name": "one process", "x": [now.whole_bytes] * 2, "y": [-0.5, n - 0.5],
                   "mode": "lines", "line": {"color": "#d62728", "dash": "dash"}, "xaxis": "x2", "yaxis": "y2",
                   "hovertemplate": f"one process's cache: {now.whole_bytes:,} bytes<extra></extra>"})
    traces += [{**t, "xaxis": "x3", "yaxis": "y3"} for t in traffic.traces]
    what = "KV heads" if memory[0].get("kv_heads") is not None else "positions"
    more = traffic.layout["title"]["text"].partition(" (the last")[2]
    titles = [(0.0, 1.0, "left", f"which {what} each rank holds"),
              (1.0, 1.0, "right", f"bytes (whole: {format_bytes(now.whole_bytes)})"),
              (0.0, 0.40, "left", "ms a pass: rank 0's collectives (red), the rest" + (f" (the last{more}" if more
                                                                                       else ""))]
    notes = [{"text": text, "x": x, "xref": "paper", "xanchor": side, "y": y, "yref": "paper", "yanchor": "bottom",
              "showarrow": False, "font": {"size": 13.0}} for x, y, side, text in titles]
    notes += [{**note, "xref": "x3", "yref": "y3"} for note in traffic.layout["annotations"]]
    layout = {"height": 410, "margin": {"l": 60, "r": 10, "t": 24, "b": 40}, "showlegend": False,
              "barmode": "stack", "annotations": notes,
              "xaxis": {**held.layout["xaxis"], "title": {"text": ""}, "domain": [0.0, 0.56], "anchor": "y"},  # (the
              # panel's title names what its columns are)
              "yaxis": {**rows, "domain": [0.66, 0.98], "anchor": "x"},
              "xaxis2": {"domain": [0.64, 1.0], "anchor": "y2", "range": [0, 1.15 * max(now.whole_bytes, 1)],
                         "tickformat": "~s", "nticks": 3},
              "yaxis2": {**rows, "domain": [0.66, 0.98], "anchor": "x2", "showticklabels": False},
              "xaxis3": {**traffic.layout["xaxis"], "domain": [0.0, 1.0], "anchor": "y3"},
              "yaxis3": {**traffic.layout["yaxis"], "domain": [0.0, 0.34], "anchor": "x3"}}
    for axis in ("yaxis", "yaxis2"):
        layout[axis].pop("range")
    return FigureSpec(traces, layout)

