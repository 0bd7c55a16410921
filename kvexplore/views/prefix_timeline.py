"""The requests a prefix cache served, one stacked bar each: the prompt tokens found in the cache (hit), those
computed again (recomputed) and the tokens generated; the frame shown is highlighted, and the hover of the
recomputed part gives each miss's reason in words. For an engine's event stream (policy ``"events"``, no requests)
a bar per event batch: the blocks it stored up, the blocks it removed down.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import SettingsError
from ..prefix.frames import EVICTED, PoolFrame
from .palette import BLOCK_COLOURS, GENERATED_COLOUR, HIT_COLOUR, RECOMPUTED_COLOUR
from .prefix_words import wrap
from .spec import FigureSpec


def _misses(frame: PoolFrame) -> str:
    r = frame.request
    if not r.misses:
        return "no miss"
    return "<br>".join(f"• {m.start}–{m.end - 1} ({m.kind}): {wrap(m.reason, 70)}" for m in r.misses)


def counts(frames: Sequence[PoolFrame]) -> dict[str, np.ndarray]:
    """Per frame that served a request: its frame index, hit, recomputed and generated tokens."""
    served = [f for f in frames if f.request is not None]
    out = {"frame": np.array([f.index for f in served], dtype=np.int32)}
    for key in ("hit_tokens", "recomputed_tokens", "generated_tokens"):
        out[key] = np.array([getattr(f.request, key) for f in served], dtype=np.int32)
    return out


def stored_removed(frames: Sequence[PoolFrame]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per event batch (frame after the first): its index, the blocks it stored, the blocks it removed."""
    later = list(frames[1:])
    index = np.array([f.index for f in later], dtype=np.int32)
    stored = np.array([sum(1 for b in f.blocks if b.stored_by == f.index) for f in later], dtype=np.int32)
    removed = np.array([f.count(EVICTED) for f in later], dtype=np.int32)
    return index, stored, removed


def ticks(frames: Sequence[PoolFrame]) -> dict:
    """The x axis' ticks: a bar sits at its frame's index, labelled with its request's own number (a pool counts
    requests from 0, its frames from 1: frame 0 is the empty pool)."""
    on = [f for f in frames if f.request is not None] if frames[0].policy != "events" else list(frames[1:])
    step = max(1, len(on) // 25)
    on = on[::step]
    return dict(tickvals=[f.index for f in on],
                ticktext=[str(f.request.index if f.request is not None else f.index) for f in on])


def _layout(title: str, frames: Sequence[PoolFrame], current: int, ytitle: str, height: int | None) -> dict:
    last = frames[-1].index
    return dict(
        title=dict(text=title, font=dict(size=15), x=0.01, xanchor="left"), barmode="relative",
        height=height or 300, margin=dict(l=60, r=10, t=50, b=45), hovermode="closest", plot_bgcolor="#ffffff",
        legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom", font=dict(size=12)),
        xaxis=dict(title=dict(text="request" if frames[0].policy != "events" else "event batch"),
                   range=[0.5, max(last, 1) + 0.5], zeroline=False, **ticks(frames)),
        yaxis=dict(title=dict(text=ytitle), zeroline=True, gridcolor="#eee"),
        shapes=[dict(type="rect", xref="x", yref="paper", x0=current - 0.5, x1=current + 0.5, y0=0, y1=1,
                     fillcolor="#fff3b0", line=dict(color="#e6a700", width=2), layer="below")])


def spec(frames: Sequence[PoolFrame], current: int, height: int | None = None) -> FigureSpec:
    """The timeline of ``frames`` with frame ``current`` (a frame's index in the list) highlighted."""
    if not frames:
        raise SettingsError("no frames to draw: serve a request first (pool.serve(...)) or pass PoolFrames")
    if not 0 <= current < len(frames):
        raise SettingsError(f"frame {current} does not exist: there are frames 0..{len(frames) - 1}")
    at = frames[current].index
    if frames[0].policy == "events":
        index, stored, removed = stored_removed(frames)
        traces = [dict(type="bar", name="stored", x=index, y=stored, marker=dict(color=BLOCK_COLOURS["written"]),
                       hovertemplate="batch %{x}: %{y} blocks stored<extra></extra>"),
                  dict(type="bar", name="removed", x=index, y=-removed, marker=dict(color=BLOCK_COLOURS["evicted"]),
                       customdata=removed, hovertemplate="batch %{x}: %{customdata} blocks removed<extra></extra>")]
        title = f"event batches · {len(index)} · batch {at}: {int(stored[current - 1]) if current else 0} stored, " \
                f"{int(removed[current - 1]) if current else 0} removed"
        return FigureSpec(traces, _layout(title, frames, at, "blocks (stored up, removed down)", height))
    c = counts(frames)
    served = [f for f in frames if f.request is not None]
    names = [f.request.label for f in served]
    traces = [
        dict(type="bar", name="hit", x=c["frame"], y=c["hit_tokens"], marker=dict(color=HIT_COLOUR),
             customdata=names, hovertemplate="%{customdata}: %{y} prompt tokens found in the cache<extra></extra>"),
        dict(type="bar", name="recomputed", x=c["frame"], y=c["recomputed_tokens"],
             marker=dict(color=RECOMPUTED_COLOUR),
             hovertext=[f"{f.request.label}: {f.request.recomputed_tokens} prompt tokens computed<br>{_misses(f)}"
                        for f in served], hoverinfo="text"),
        dict(type="bar", name="generated", x=c["frame"], y=c["generated_tokens"], marker=dict(color=GENERATED_COLOUR),
             customdata=names, hovertemplate="%{customdata}: %{y} tokens generated<extra></extra>"),
    ]
    r = frames[current].request
    title = ("requests · hit, recomputed, generated tokens" if r is None else
             f"requests · {r.label}: {r.hit_tokens} hit, {r.recomputed_tokens} recomputed, "
             f"{r.generated_tokens} generated")
    return FigureSpec(traces, _layout(title, frames, at, "tokens", height))
