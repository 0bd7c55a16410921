"""Compare: strategies run in lockstep on the same prompt and seed, side by side.

The table (HTML): does each strategy produce the reference's tokens, its top-1 agreement and mean KL divergence from
the reference (lossy caches: quantized, a sink that has evicted), the model's forward time per step (median and the
middle half of the steps: the lanes step in a rotating order after an untimed warm-up, so their times compare), the
bytes it holds and copies. Below, forward time per step and KL per step for every strategy.
"""

from __future__ import annotations

import html
import statistics
from collections.abc import Collection, Mapping, Sequence

from ..trace.records import StepRecord
from ..caches.memory import format_bytes as size
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


# what the table's head shows of each column (the full name of COLUMNS is its tooltip): short words, so a column
# beside the cache map holds the table at 1280 x 800, presenting too
HEADS = ("strategy", "own token = ref.", "top-1 agree", "mean KL (nats)", "ms / step (median, mid half)",
         "reserved", "copied / step")


def table_html(table: Sequence[Sequence[str]], notes: Mapping[str, str] | None = None) -> str:
    """:func:`rows` as an HTML table (plain HTML: it renders the same in JupyterLab, Voila and exported pages), and
    below it ``notes``: lane -> what its lossy cache did so far (a lane that has lost nothing yet says why)."""
    head = "".join(f'<th title="{html.escape(c)}">{html.escape(h)}</th>' for c, h in zip(COLUMNS, HEADS))
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table)
    said = "".join(f"<li><b>{html.escape(lane)}</b>: {html.escape(text)}</li>" for lane, text in (notes or {}).items()
                   if text)
    return (f'<div class="kvx-compare-scroll" style="overflow-x:auto;max-width:100%">'  # narrower than the table:
            f'<table class="kvx-compare-table" style="border-collapse:collapse;font-size:13px;margin:4px 0;'  # it
            f'width:100%">'
            f'<thead style="background:#e8eef6"><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
            + (f'<ul class="kvx-compare-notes" style="margin:2px 0;padding-left:18px">{said}</ul>' if said else "")
            + "<style>.kvx-compare-table th,.kvx-compare-table td{padding:3px 6px;text-align:left;"
            "border-bottom:1px solid #ddd;white-space:normal}"
            ".kvx-compare-table th{vertical-align:bottom;font-weight:600}"
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
    layout = dict(height=330, margin=dict(l=70, r=20, t=50, b=90),
                  title=dict(text=f"per step, strategies in lockstep · reference: {reference}", font=dict(size=13)),
                  xaxis=dict(domain=[0, 0.44], anchor="y"),
                  yaxis=dict(domain=[0, 1], anchor="x", title=dict(text="ms / step (solid)"),
                              rangemode="tozero"),
                  xaxis2=dict(domain=[0.56, 1], anchor="y2"),
                  yaxis2=dict(domain=[0, 1], anchor="x2", title=dict(text="KL (dotted)"),
                              rangemode="tozero", exponentformat="e"),
                  legend=dict(font=dict(size=11), orientation="h", x=0, xanchor="left", y=-0.25, yanchor="top"))
    return FigureSpec(traces, layout)


def from_snapshot(s) -> FigureSpec:
    return spec(s.records(), {n: l.kl for n, l in s.lanes.items()}, s.reference)


def notes_from_snapshot(s) -> dict[str, str]:
    """What each lossy lane's cache did so far (empty for exact caches)."""
    return {n: l.did for n, l in s.lanes.items() if l.did}


def rows_from_snapshot(s) -> list[list[str]]:
    return rows(s.records(), {n: l.kl for n, l in s.lanes.items()}, {n: l.top1 for n, l in s.lanes.items()},
                s.reference, forced={n: l.forced for n, l in s.lanes.items()})
