"""Type on a figure of a given size: titles wrapped to the width a figure has on screen (at their `` · ``
separators), the top margin a title of so many lines needs, and every font raised to a floor (presentation mode).
The explorer fits each figure with these before it is sent (:func:`kvexplore.explorer.controls.fit`).
"""

from __future__ import annotations

import re
from typing import Any

LINE = 1.3  # a title line's height, in font sizes
PAD = 10  # pixels above the first line of a title
CHAR = 0.56  # a character's mean width, in font sizes (proportional sans-serif)
SEPARATOR = " · "


def title_height(text: str, size: float) -> float:
    """Pixels from the figure's top to the bottom of a title of ``text`` (lines split at ``<br>``) at font ``size``
    placed by :func:`place_title`."""
    return _top(text, size) + LINE * size * (text.count("<br>") + 1) + PAD / 2 if text else 0.0


def _top(text: str, size: float) -> float:
    """Where :func:`place_title` anchors a title, in pixels from the figure's top: plotly draws a title anchored at
    its top about a quarter of a line higher, and each further line a third of a font size higher again."""
    return PAD + size * (0.3 + 0.36 * text.count("<br>"))


def place_title(layout: dict, below: float) -> None:
    """Anchor ``layout``'s title near the figure's top and make the top margin its lines and ``below`` pixels
    (what the figure draws between its title and its plot: panel labels, a legend)."""
    title = layout.get("title")
    if not isinstance(title, dict) or not title.get("text"):
        return
    text, size = str(title["text"]), float(title.setdefault("font", {}).get("size", 13))
    layout.setdefault("margin", {})["t"] = round(title_height(text, size) + below)
    title.update(yref="container", y=round(1 - _top(text, size) / max(1, layout.get("height", 400)), 4),
                 yanchor="top")


def wrap(text: str, size: float, width: float) -> str:
    """``text`` with every line longer than ``width`` pixels at font ``size`` broken at its `` · `` separators (a
    part longer than a line stays whole)."""
    most = max(12, int(width / (CHAR * size)))
    lines = []
    for line in text.split("<br>"):
        for part in _split(line, SEPARATOR, " ·", most):
            lines += _split(part, " ", "", most)  # a part still too long: at its spaces
    return "<br>".join(lines)


def _split(line: str, at: str, ends: str, most: int) -> list[str]:
    """``line`` in pieces of at most ``most`` visible characters, cut at ``at`` (each piece but the last ending
    with ``ends``); a line that fits, or cannot be cut, comes back whole."""
    if _visible(line) <= most or at not in line:
        return [line]
    out, current = [], ""
    for part in line.split(at):
        joined = f"{current}{at}{part}" if current else part
        if current and _visible(joined) + len(ends) > most:  # the piece ends with ``ends`` when cut here
            out.append(current + ends)
            current = part
        else:
            current = joined
    return out + [current]


def _visible(line: str) -> int:
    """Characters of ``line`` a reader sees (tags such as ``<sup>`` left out)."""
    return len(re.sub(r"<[^>]*(>|$)|>", "", line))


def at_least(tree: Any, size: float) -> None:
    """Raise every ``font``/``tickfont``/``textfont`` size in ``tree`` (a layout or a trace, nested dicts and lists)
    to ``size`` at least, in place."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            if key in ("font", "tickfont", "textfont", "insidetextfont", "outsidetextfont") and isinstance(value, dict):
                if value.get("size", 0) < size:
                    value["size"] = size
            at_least(value, size)
    elif isinstance(tree, list):
        for value in tree:
            if isinstance(value, (dict, list)):
                at_least(value, size)


def fit_notes(layout: dict, width: float) -> None:
    """Wrap the notes centred on a figure (paper annotations at x = 0.5, the "nothing to show" sentences) and the
    panels' labels (at x = 0, anchored left) to ``width`` pixels at their font."""
    for note in layout.get("annotations") or []:
        if not (isinstance(note, dict) and note.get("xref") == "paper" and note.get("text")):
            continue
        centred, label = note.get("x") == 0.5, note.get("x") == 0 and note.get("xanchor") == "left"
        if centred or label:  # a panel's label (left, growing up from the panel) wraps to the width as well
            note["text"] = wrap(str(note["text"]), float((note.get("font") or {}).get("size", 13)), width)


def fit_title(layout: dict, width: float, floor: float | None = None) -> None:
    """Wrap ``layout``'s title to ``width`` pixels (at its font, raised to ``floor``) and give it the top margin its
    lines need, keeping the room the figure had below its title (a legend, panel labels)."""
    title = layout.get("title")
    if not isinstance(title, dict) or not title.get("text"):
        return
    font = title.setdefault("font", {})
    before = float(font.get("size", 13))
    old = str(title["text"])
    below = max(0.0, float(layout.get("margin", {}).get("t", 80)) - title_height(old, before))
    if floor:  # what sits below the title (panel labels of about 12 px) grows with the text too
        below += max(0.0, 1.3 * (floor - 2 - 12))
    font["size"] = max(before, floor or 0)
    title["text"] = wrap(old, font["size"], width)
    place_title(layout, below)
