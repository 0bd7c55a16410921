"""A prefix cache in words: a block's or a node's tokens as hover text, and the story of one frame (what the request
found in the cache, what it computed again and why, what the frame evicted) as plain text and as HTML, for the
widget's panel and the HTML replay.
"""

from __future__ import annotations

import html
import textwrap

from ..caches.memory import format_bytes
from ..prefix.frames import MISS_KINDS, PoolFrame

IDS_SHOWN = 24  # token ids listed in a hover at most (a block of 16 shows all)
STORY_STYLE = ("font-size: 15px; line-height: 1.4; padding: 8px 12px; background: #fafafa; border: 1px solid #ddd; "
               "border-radius: 4px")  # the same in a notebook (whose widgets set their own line height) and a page
NOTES_SHOWN = 8  # a frame's notes listed at most (an eviction under pressure may drop hundreds of blocks)


def visible(text: str) -> str:
    """``text`` with its spaces, tabs and newlines made visible (a block often starts or ends in one)."""
    return text.replace(" ", "·").replace("\t", "→").replace("\n", "↵")


def wrap(text: str, width: int = 60) -> str:
    """``text`` escaped for a plotly hover and wrapped in lines of ``width`` characters (``<br>`` between)."""
    lines = textwrap.wrap(text, width, break_long_words=True, replace_whitespace=False, drop_whitespace=False)
    return "<br>".join(html.escape(line) for line in lines) or ""


def tokens_hover(tokens: tuple[int, ...], text: str) -> str:
    """The hover lines of a run of tokens: its text (visible spaces) and its ids."""
    ids = ", ".join(map(str, tokens[:IDS_SHOWN])) + (", …" if len(tokens) > IDS_SHOWN else "")
    lines = [f"“{wrap(visible(text))}”"] if text else []
    return "<br>".join([*lines, f"ids [{ids}]"]) if tokens else "no tokens"


def label(text: str, limit: int = 8, lines: int = 1) -> str:
    """A short label of a run of tokens, for a cell or a node too small for the whole text: at most ``lines``
    lines of ``limit`` characters, the last ending in "…" when the text is longer."""
    shown = visible(text)
    parts = [shown[i:i + limit] for i in range(0, len(shown), limit)] or [""]
    if len(parts) > lines:
        parts = parts[:lines]
        parts[-1] = parts[-1][: limit - 1] + "…"
    return "<br>".join(html.escape(p) for p in parts)


def _request_lines(frame: PoolFrame) -> list[str]:
    r = frame.request
    shared = frame.bytes_per_block and r.bytes_shared // frame.bytes_per_block
    lines = [] if "prompt tokens" in frame.title else [  # (a pool's frame title already counts them)
        f"{r.label}: {r.prompt_tokens} prompt tokens: {r.hit_tokens} hit, {r.recomputed_tokens} recomputed, "
        f"{r.generated_tokens} generated"]
    lines.append(f"shared from the cache: {format_bytes(r.bytes_shared)}"
                 + (f" ({shared} block{'s' if shared != 1 else ''})" if shared else ""))
    if not r.misses:
        lines.append("nothing recomputed that could have been shared")
    for m in r.misses:
        lines.append(f"tokens {m.start}–{m.end - 1} recomputed ({m.kind}): {m.reason or MISS_KINDS.get(m.kind, '')}")
    return lines


def memory_words(frame: PoolFrame, lead: str = " · ") -> str:
    """The frame's memory in a few words where the pages and vLLM's hybrid manager differ (sliding shares freed), and
    its offload tiers' fill; empty otherwise."""
    parts = []
    mem = frame.meta.get("memory") or {}
    if mem.get("sliding_freed_blocks"):
        parts.append(f"{format_bytes(mem['vllm'])} as vLLM holds it ({format_bytes(mem['pages'])} in pages; "
                     f"{mem['sliding_freed_blocks']} blocks' sliding layers freed)")
    for medium, t in (frame.meta.get("tiers") or {}).items():
        parts.append(f"{medium} tier {t['blocks']}/{t['capacity']} blocks")
    return lead + ", ".join(parts) if parts else ""


def explain(frame: PoolFrame) -> list[str]:
    """The frame's story, one line per fact: the request's counts and each miss's reason, then the frame's notes
    (evictions, events); the pool's counts last."""
    lines = [frame.title] if frame.title else []
    if frame.request is not None:
        lines += _request_lines(frame)
    elif frame.index == 0 and frame.policy != "events":
        lines.append(f"the empty pool: {frame.num_blocks} blocks of {frame.block_size} tokens, all free")
    lines += list(frame.notes[:NOTES_SHOWN])
    if len(frame.notes) > NOTES_SHOWN:
        lines.append(f"… and {len(frame.notes) - NOTES_SHOWN} more")
    counts = ", ".join(f"{frame.count(s)} {s}" for s in ("cached", "hit", "written", "held", "evicted", "free")
                       if frame.count(s))
    lines.append(f"pool ({frame.policy}): {counts or 'empty'}; {len(frame.free_queue)} blocks in the free queue"
                 f"{memory_words(frame, '; ')}")
    return lines


def explain_html(frame: PoolFrame) -> str:
    """:func:`explain` as HTML: the first line a heading, the misses and notes a list, the counts small."""
    lines = explain(frame)
    head, body, tail = lines[0], lines[1:-1], lines[-1]
    items = "".join(f"<li>{html.escape(t)}</li>" for t in body)
    return (f'<div class="kvx-prefix-story" style="{STORY_STYLE}"><b>{html.escape(head)}</b>'
            f'<ul style="margin: 6px 0; padding-left: 20px">{items}</ul><small>{html.escape(tail)}</small></div>')
