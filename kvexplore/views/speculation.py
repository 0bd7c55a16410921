"""Speculative decoding over the steps, for the lane shown: the accepted and rejected drafts of every verification
(stacked, at the step of its last token) and the tokens each forward pass gave, with the mean so far; the title says
the drafter, the counts, how the cache took the rejected drafts back and the doctor's verdict (docs/explorer.md, "A
speculative lane"). The bars and lines come from the records alone, so a replay draws them too; the take-back's way
and the doctor need the live lane (:class:`~.snapshot.SpecInfo`).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from itertools import groupby

import numpy as np

from ..trace.records import StepRecord
from . import onscreen
from .press import empty
from .snapshot import MAX_BINS, SpecInfo
from .spec import FigureSpec

ACCEPTED, REJECTED, TOKENS, MEAN = "#2ca02c", "#d62728", "#1f77b4", "#222222"
TITLE_LINES = 7  # lines of title at most (the panel beside the cache map is short)


def drafts(records: Sequence[StepRecord]) -> bool:
    """Whether a lane's records hold a verification (the lane drafts): the view applies to it."""
    return any(r.verification is not None for r in records)


def passes(records: Sequence[StepRecord]) -> list[tuple[int, int, int, int]]:
    """Every forward pass after the prefill: (its last record's step, tokens it gave, drafted, accepted)."""
    out: list[tuple[int, int, int, int]] = []
    for verification, run in groupby(records, key=lambda r: r.verification):
        group = list(run)
        if verification is None:
            out += [(r.step, 1, 0, 0) for r in group if r.is_decode]
        else:  # one verification: its records in a row
            out.append((group[-1].step, len(group), group[0].input_len - 1, sum(x.accepted for x in group)))
    return out


def _sums(at: np.ndarray, values: np.ndarray, b, n: int) -> np.ndarray:
    out = np.zeros(b.count, dtype=np.int64)
    on = (at >= b.start) & (at < min(b.stop, n))
    np.add.at(out, (at[on] - b.start) // b.size, values[on])
    return out


def _lines(info: SpecInfo | None, found: list) -> tuple[list[str], str]:
    """The title's lines (short) and the whole story for the hover of "details": every layer's way, the recompute's
    reason and the doctor's full verdict."""
    drafted = sum(p[2] for p in found)
    accepted = sum(p[3] for p in found)
    verifications = sum(1 for p in found if p[2])
    share = f" ({accepted / drafted:.0%})" if drafted else ""
    counts = (f"{verifications} verifications: {drafted} drafted, {accepted} accepted{share} · "
              f"{sum(p[1] for p in found)} tokens in {len(found)} passes")
    if info is None:
        return [counts], counts
    lines = [counts]
    detail = [f"{info.drafter}, {info.k} drafted per verification · {counts}"]
    last = next((v for v in reversed(info.verifications) if v.rolled_back), None)
    if info.paced_by is not None:
        lines.append(f"paced by {info.paced_by}: drafts at most its verification's tokens less one")
    if last is None:
        lines.append("nothing taken back yet" + (": every draft so far was accepted" if drafted else ""))
    else:
        gone = f"take-back {last.index}: positions {last.pos + last.kept}–{last.pos + last.written - 1}"
        if last.take_back == "recompute":
            lines.append(f"{gone} rolled back, the {last.kept} kept written again (recompute): {last.why}")
        else:
            ways = list(dict.fromkeys(info.ways.values()))
            lines.append(f"{gone} cut (truncate)" + (f": {ways[0]}" if len(ways) == 1 else
                                                        ": each layer its own way (details)"))
        detail.append(lines[-1])
    detail += [f"{name}: {way}" for name, way in info.ways.items()]
    if info.checkup is not None:
        lines.append(info.checkup)
        detail.append(info.checkup_detail or info.checkup)
    return lines, "<br>".join(_wrap(t, 90) for t in detail)


def _fit(lines: list[str], budget: int = TITLE_LINES - 1) -> list[str]:
    """``lines`` wrapped, at most ``budget`` screen lines: the longest (a take-back's way) is cut short first,
    ending in "… (details)" (the hover has it whole); the first and the last line (the counts, the doctor) stay."""
    wrapped = [_wrap(t).split("<br>") for t in lines]
    while sum(map(len, wrapped)) > budget:
        i = max(range(len(wrapped)), key=lambda j: (len(wrapped[j]), j))  # a tie: the later line
        if len(wrapped[i]) == 1:
            break
        wrapped[i] = [*wrapped[i][:-2], wrapped[i][-2] + " … (details)"]
    return [line for w in wrapped for line in w]


def _wrap(text: str, width: int = 70) -> str:
    """``text`` in lines of at most ``width`` characters (words kept whole), joined for a plotly title."""
    return "<br>".join(textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""])


def spec(records: Sequence[StepRecord], strategy: str, info: SpecInfo | None = None, zoom: dict | None = None,
         max_bins: int = MAX_BINS) -> FigureSpec:
    if not records:
        return empty("no step yet: enter a prompt and press Prefill", f"speculation · {strategy}")
    if info is None and not drafts(records):
        return empty(f"{strategy} does not draft: run a speculative lane beside it<br>(strategies=[..., "
                     f"'preallocated@spec'], strategy_options={{'preallocated@spec': {{'draft': "
                     f"'prompt-lookup', 'draft_tokens': 4}}}})", f"speculation · {strategy}")
    found = passes(records)
    n = records[-1].step + 1
    at = np.array([p[0] for p in found], dtype=np.int64)
    gained, drafted, accepted = (np.array([p[i] for p in found], dtype=np.int64) for i in (1, 2, 3))
    b, view_range = onscreen.axis_bins(zoom, "xaxis", n, (-0.5, n - 0.5), max_bins)
    x = onscreen.centres(b)
    count = _sums(at, np.ones_like(at), b, n)
    acc, dr, tok = _sums(at, accepted, b, n), _sums(at, drafted, b, n), _sums(at, gained, b, n)
    on = count > 0
    where = "step %{x}" if b.exact else f"steps around %{{x}} (bins of {b.size})"
    drafted_on = on & (dr > 0)
    traces = [
        dict(type="bar", name="accepted", x=x[drafted_on], y=acc[drafted_on], marker=dict(color=ACCEPTED),
             width=0.8 * b.size, xaxis="x", yaxis="y",
             hovertemplate=f"{where}<br>%{{y}} drafts accepted<extra></extra>"),
        dict(type="bar", name="rejected", x=x[drafted_on], y=(dr - acc)[drafted_on], marker=dict(color=REJECTED),
             width=0.8 * b.size, xaxis="x", yaxis="y",
             hovertemplate=f"{where}<br>%{{y}} drafts rejected (taken back)<extra></extra>"),
        dict(type="scatter", name="tokens per pass", x=x[on], y=(tok[on] / count[on]).astype(np.float32),
             mode="lines+markers" if on.sum() < 80 else "lines", xaxis="x2", yaxis="y2",
             line=dict(color=TOKENS, width=2), marker=dict(size=5),
             hovertemplate=f"{where}<br>%{{y:.2f}} tokens per forward pass<extra></extra>"),
    ]
    ends = np.cumsum(gained) / np.arange(1, len(gained) + 1) if len(gained) else np.zeros(0)
    last_in = np.searchsorted(at, b.edges() + b.size - 1, side="right") - 1  # the last pass up to each bin's end
    mean_on = on & (last_in >= 0)
    traces.append(dict(type="scatter", name="mean so far", x=x[mean_on], y=ends[last_in[mean_on]].astype(np.float32),
                       mode="lines", xaxis="x2", yaxis="y2", line=dict(color=MEAN, dash="dot", width=1.5),
                       hovertemplate=f"{where}<br>%{{y:.2f}} tokens per pass so far<extra></extra>"))
    lines, detail = _lines(info, found)
    drafter = f" · {info.drafter}, {info.k} per verification" if info is not None else ""
    title = "<br>".join([f"speculation · {strategy}{drafter}", *_fit(lines)])
    shown = onscreen.describe(b, n, "steps")
    top = max(int(dr.max(initial=0)), 1)
    layout = dict(
        barmode="stack", hovermode="closest", margin=dict(l=50, r=10, t=28 + 15 * (title.count("<br>") + 1), b=36),
        height=480 + 16 * title.count("<br>"), showlegend=False,
        title=dict(text=title, font=dict(size=11), x=0.01, xanchor="left", y=1, yref="container", yanchor="top",
                   pad=dict(t=20)),
        xaxis=dict(domain=[0, 1], anchor="y", range=view_range, autorange=False, showticklabels=False),
        yaxis=dict(domain=[0.55, 0.94], anchor="x", range=[0, top + 0.5], title=dict(text="drafts")),
        xaxis2=dict(domain=[0, 1], anchor="y2", matches="x", range=view_range, autorange=False,
                    title=dict(text="step" + (f"<br>{shown}" if shown else ""), standoff=2)),
        yaxis2=dict(domain=[0.0, 0.42], anchor="x2", rangemode="tozero",
                    range=[0, max(float(gained.max(initial=1)), 1.0) + 0.5], title=dict(text="tokens / pass")),
        annotations=[dict(text=t, xref="paper", yref="paper", x=0, y=y, xanchor="left", yanchor="bottom",
                          showarrow=False, font=dict(size=11))
                     for t, y in ((f"drafts per verification: <span style='color:{ACCEPTED}'>accepted</span> + "
                                   f"<span style='color:{REJECTED}'>rejected</span>", 0.94),
                                  (f"<span style='color:{TOKENS}'>tokens per forward pass</span> · mean so far "
                                   "(dotted)", 0.42))]
        + [dict(text="<u>details</u>", hovertext=detail, xref="paper", yref="paper", x=1, y=0.94, xanchor="right",
                yanchor="bottom", showarrow=False, font=dict(size=11, color="#1f77b4"))])
    return FigureSpec(traces, layout)


def from_snapshot(s) -> FigureSpec:
    lane = s.lane
    return spec(lane.history, lane.kind, lane.speculation, s.zoom.get("speculation"), s.max_bins)
