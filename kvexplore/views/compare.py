"""Compare: strategies run in lockstep on the same prompt and seed, side by side.

The table (HTML): does each strategy produce the reference's tokens, its top-1 agreement and mean KL divergence from
the reference, the model's forward time per step (median and the middle half of the steps) and the bytes it holds
and copies; the lossy lanes' notes fold under one line. Below, forward time per step and KL per step for every
strategy.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Collection, Mapping, Sequence

from ..trace.records import StepRecord
from ..caches.memory import format_bytes as size
from .divergence import KL_PARTS
from .palette import strategy_colour
from .spec import FigureSpec

COLUMNS = ("strategy", "own choice = reference token", "top-1 agreement", "mean KL (nats)",
           "forward ms / step (median, middle half)",
           "reserved", "copied / step (last)")


def rows(lanes: Mapping[str, Sequence[StepRecord]], kl: Mapping[str, Sequence[float | None]],
         top1: Mapping[str, Sequence[bool | None]], reference: str,
         forced: Mapping[str, Collection[int]] | None = None) -> list[list[str]]:
    """One row per strategy, the columns of :data:`COLUMNS` as text. ``forced[name]``: the steps at which that
    lane was fed the reference's token; there its own choice is its most likely token, compared with the
    reference's most likely token (the token it was given says nothing)."""
    ref = lanes.get(reference, [])
    forced = forced or {}
    out = []
    for name, records in lanes.items():
        given = forced.get(name, ())
        # where the lane was given the reference's token, compare most likely tokens (the reference's token may
        # have been sampled); elsewhere the tokens each one took
        same = sum((a.top[0].token_id == b.top[0].token_id) if a.step in given else (a.token_id == b.token_id)
                   for a, b in zip(records, ref))
        agree = [x for x in top1.get(name, []) if x is not None]
        kls = [x for x in kl.get(name, []) if x is not None]
        decode = [r.forward_s for r in records if r.is_decode]
        last = records[-1].memory if records else None
        out.append([
            name + (" (ref.)" if name == reference else ""),
            f"{same}/{len(records)}" if name != reference else "—",
            f"{100 * sum(agree) / len(agree):.1f}%" if agree else "—",
            f"{statistics.fmean(kls):.2e}" if kls else "—",
            _timing(decode),
            size(last.reserved_bytes) if last else "—",
            size(last.copied_bytes) if last else "—",
        ])
    return out


def _timing(seconds: Sequence[float]) -> str:
    """Median forward time in ms, with the 25th to 75th percentile once there are four steps."""
    if not seconds:
        return "—"
    ms = [1000 * s for s in seconds]
    text = f"{statistics.median(ms):.1f}"
    if len(ms) >= 4:
        q1, _, q3 = statistics.quantiles(ms, n=4)
        text += f" ({q1:.1f}–{q3:.1f})"
    return text


# what the table's head shows of each column, on one line (the full name and what KL means are its tooltip)
HEADS = ("strategy", "same token", "top-1", "mean KL", "ms / step", "reserved", "copied / step")
KL_MEANS = ("how far this lane's next-token distribution is from the reference lane's at the same step: the "
            "Kullback-Leibler divergence KL(reference || lane) in nats, averaged over the steps; 0 for the same "
            "distribution, about 1e-9 from float32 rounding alone (two exact caches summing in another order), "
            f"above {KL_PARTS:g} the token strip marks a drift")
KL_LINE = "KL: next-token distribution vs the reference's, in nats (float32 rounding alone: ~1e-9)"  # its title: more
TIPS = dict(zip(COLUMNS, ("", "the steps at which this lane chose the reference's token",
                          "the share of steps whose most likely token is the reference's", KL_MEANS,
                          "the median forward pass in ms, and the 25th to 75th percentile of the steps",
                          "the bytes its storage for keys and values reserves after the last step",
                          "the bytes the last step copied")))
EXPLAINED = ' class="kvx-explained"'  # a head whose tooltip says what it means: dotted underline, a help cursor


def table_html(table: Sequence[Sequence[str]], notes: Mapping[str, str] | None = None) -> str:
    """:func:`rows` as an HTML table (plain HTML: it renders the same in JupyterLab, Voila and exported pages), a
    line saying what KL is, and ``notes``: lane -> what its lossy cache did so far (a lane that has lost nothing yet
    says why), folded under one line that names the lanes."""
    head = "".join(f'<th title="{html.escape(c + (": " + TIPS[c] if TIPS[c] else ""))}"'
                   f'{EXPLAINED if TIPS[c] == KL_MEANS else ""}>{html.escape(h)}</th>' for c, h in zip(COLUMNS, HEADS))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table)
    said = {lane: text for lane, text in (notes or {}).items() if text}
    items = "".join(f"<li><b>{html.escape(lane)}</b>: {html.escape(text)}</li>" for lane, text in said.items())
    return (f'<div class="kvx-compare-scroll" style="overflow-x:auto;max-width:100%">'  # narrower than the table:
            f'<table class="kvx-compare-table" style="border-collapse:collapse;font-size:13px;margin:2px 0">'  # it
            f'<thead style="background:#e8eef6"><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'  # scrolls
            f'<div class="kvx-compare-kl kvx-compare-small" title="{html.escape(KL_MEANS)}" style="color:#555">'
            f'{html.escape(KL_LINE)}</div>'
            + (f'<details class="kvx-compare-notes kvx-compare-small"><summary style="cursor:pointer">what the lossy '
               f'caches did: {html.escape(", ".join(said))}</summary><ul style="margin:2px 0;padding-left:18px">'
               f'{items}</ul></details>' if said else "")
            + "<style>.kvx-compare-table th,.kvx-compare-table td{padding:1px 6px;text-align:left;"
            "border-bottom:1px solid #ddd;white-space:nowrap;line-height:1.25}"
            # the lines under the table in smaller type, but never under the presenting floor
            ".kvx-compare-small{font-size:12px;line-height:1.3}.kvx-presenting .kvx-compare-small{font-size:inherit}"
            ".kvx-compare-notes:not([open])>ul{display:none}"  # folded: not laid out (nor measured) at all
            ".kvx-compare-table th{vertical-align:bottom;font-weight:600}"
            ".kvx-compare-table th.kvx-explained{text-decoration:underline dotted;cursor:help}"
            ".kvx-compare-table td:first-child{position:sticky;left:0;background:#fff}"
            "</style>")


def spec(lanes: Mapping[str, Sequence[StepRecord]], kl: Mapping[str, Sequence[float | None]],
         reference: str) -> FigureSpec:
    """Time per step and KL divergence per step, one colour per strategy (the table is :func:`table_html`)."""
    traces = []
    for i, (name, records) in enumerate(lanes.items()):
        decode = [r for r in records if r.is_decode]
        traces.append(dict(type="scatter", mode="lines+markers", name=name, legendgroup=name,
                           x=[r.step for r in decode], y=[1000 * r.forward_s for r in decode],
                           line=dict(color=strategy_colour(i)), marker=dict(size=4), xaxis="x", yaxis="y",
                           hovertemplate=f"{name}<br>step %{{x}}: %{{y:.1f}} ms<extra></extra>"))
        ks = list(kl.get(name, []))
        traces.append(dict(type="scatter", mode="lines+markers", name=f"KL · {name}", legendgroup=name,
                           showlegend=False,  # one legend entry per strategy: its colour in both panels
                           x=[r.step for r in records][:len(ks)], y=ks, marker=dict(size=4),
                           line=dict(color=strategy_colour(i), dash="dot"), xaxis="x2", yaxis="y2",
                           hovertemplate=f"{name}<br>step %{{x}}: KL %{{y:.2e}}<extra></extra>"))
    # short: the tab's height less the table's (about 280 px): one line of title, a row of legend, the panels
    layout = dict(height=280, margin=dict(l=60, r=10, t=34, b=44),
                  title=dict(text=f"per step · reference: {reference}", font=dict(size=13)),
                  xaxis=dict(domain=[0, 0.44], anchor="y"),
                  yaxis=dict(domain=[0, 1], anchor="x", title=dict(text="ms / step (solid)"),
                              rangemode="tozero"),
                  xaxis2=dict(domain=[0.58, 1], anchor="y2"),
                  yaxis2=dict(domain=[0, 1], anchor="x2", title=dict(text="KL (dotted)"),
                              rangemode="tozero", exponentformat="e"),
                  legend=dict(font=dict(size=11), orientation="h", x=0, xanchor="left", y=-0.14, yanchor="top"))
    return FigureSpec(traces, layout)


def from_snapshot(s) -> FigureSpec:
    return spec(s.records(), {n: l.kl for n, l in s.lanes.items()}, s.reference)


def notes_from_snapshot(s) -> dict[str, str]:
    """What each lossy lane's cache did so far (empty for exact caches)."""
    return {n: l.did for n, l in s.lanes.items() if l.did}


def rows_from_snapshot(s) -> list[list[str]]:
    return rows(s.records(), {n: l.kl for n, l in s.lanes.items()}, {n: l.top1 for n, l in s.lanes.items()},
                s.reference, forced={n: l.forced for n, l in s.lanes.items()})
