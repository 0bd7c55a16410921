"""Recorded runs as HTML: :func:`fragment` (one element: the frames, the player and plotly.js, to put in a page) and
:func:`save_html` (a whole self-contained document, needing no kernel and no network).

Three places draw a run as a page, all from here: :mod:`kvexplore.replay` (and ``kvexplore export``), an explorer's
``save_html``, and a notebook's static copy of an explorer (the fragment). The data and plotly.js travel
gzip-compressed. Importing this module registers :func:`save_html` as the writer of ``History.save_html`` (see
:func:`kvexplore.trace.files.register_html_writer` for why the trace layer does not import it).
"""

from __future__ import annotations

import base64
import gzip
import html
import json
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..errors import missing_extra
from ..trace.files import register_html_writer
from ..trace.records import StepRecord
from . import tokens
from .frames import frames, model_info, pick_list, texts
from .player import FRAGMENT, PLAYER
from .registry import TABS, replayed


def fragment(runs: Mapping[str, Sequence[StepRecord]], layer: int = 0, head: int = 0, title: str | None = None,
             marks: Mapping[int, str] | None = None, plotly: bool = True, side_by_side: bool = False,
             picks: Sequence[Sequence[int]] | None = None) -> str:
    """The replay as one HTML element (its data, its player and, with ``plotly``, plotly.js), to put in a page:
    :func:`save_html` wraps it in a document; a notebook's static copy of an explorer embeds it. Without ``plotly``
    it waits for another fragment on the page to bring plotly.js. ``side_by_side``: the lanes in columns (each
    lane's figures one above the other), as ``kvexplore diff --html`` shows two runs. ``picks``: more (layer, head)
    pairs the page can switch to (a selector), after ``(layer, head)``, which it opens at."""
    all_frames, store = frames(runs, layer, head, picks)
    config = model_info(next(iter(runs.values())))
    per_lane, per_run = replayed(runs)
    meta = {"title": title or f"kvexplore replay · {config.name or 'model'} · {', '.join(runs)}",
            "lanes": list(runs), "layer": layer, "head": head, "steps": len(all_frames),
            "picks": [list(p) for p in pick_list(layer, head, picks)],
            "model": {"layers": config.num_layers, "heads": config.num_heads},
            "tabs": list(TABS),  # the app's tab names (a link's tab=), with or without a figure here
            "views": {"lane": [v.name for v in per_lane], "run": [v.name for v in per_run]},
            "marks": {str(k): v for k, v in (marks or {}).items()},
            "prompt": {name: tokens.prompt_spans(texts(run, -1)) for name, run in runs.items()},
            "spans": {name: [tokens.token_span(r) for r in run] for name, run in runs.items()},
            "style": tokens.STYLE}
    packed = pack({"meta": meta, "arrays": store.arrays, "frames": all_frames})
    plotly_js = plotly_script() if plotly else ""
    uid = f"kvx-replay-{uuid.uuid4().hex[:12]}"  # two identical replays on one page are still two
    return (FRAGMENT.replace("__ID__", uid).replace("__SIDE__", " kvx-side" if side_by_side else "")
            .replace("__TITLE__", html.escape(meta["title"]))
            .replace("__PLOTLY__", plotly_js).replace("__DATA__", packed).replace("__PLAYER__", PLAYER))


def pack(data: object) -> str:
    """``data`` as the page carries it: JSON (no NaN), gzip-compressed, base64 (unpacked by :data:`.player.UNPACK`)."""
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    return base64.b64encode(gzip.compress(text.encode(), 6, mtime=0)).decode()


def plotly_script() -> str:
    """plotly.js (the installed plotly package's copy), packed in a script element the player runs once per page."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError as e:  # the notebook extra is missing: say so, with the pip command that installs it
        error = missing_extra("an HTML replay", e)
        if error is None:
            raise
        raise error from e
    packed_js = base64.b64encode(gzip.compress(get_plotlyjs().encode(), 6, mtime=0)).decode()
    return f'<script type="application/octet-stream" class="kvx-plotly">{packed_js}</script>'


def document(body: str, title: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'</head>\n<body style="margin: 12px 18px">\n{body}\n</body></html>\n')


def save_html(runs: Mapping[str, Sequence[StepRecord]], path: str | Path, layer: int = 0, head: int = 0,
              title: str | None = None, marks: Mapping[int, str] | None = None, side_by_side: bool = False,
              picks: Sequence[Sequence[int]] | None = None) -> Path:
    """Write the replay of ``runs`` (lane name -> records, as ``Explorer`` or ``load_trace`` give them) to ``path``.
    ``marks``: step -> a note shown at that step (the diff marks where two runs part). ``picks``: more (layer, head)
    pairs to hold besides ``(layer, head)`` (``picks=[(3, 1)]``), picked with a selector on the page and by a link
    (``page.html#step=37&layer=3&head=1&tab=attention``); only the figures a pick changes are stored again."""
    path = Path(path)
    body = fragment(runs, layer, head, title, marks, side_by_side=side_by_side, picks=picks)
    path.write_text(document(body, title or "kvexplore replay"), encoding="utf-8")
    return path


register_html_writer(save_html)
