"""What an explorer holds, as plain data (:func:`state`: its specs, comparison rows, views on screen, last error),
and, with ``KVEXPLORE_INSPECT=1`` in the kernel, a hidden element (class ``kvx-truth``) holding it as JSON after
every refresh, so a browser test can compare it with each plotly figure's ``gd.data`` (a second connection to the
kernel cannot ask instead: Voila refuses execute requests from the page).
"""

from __future__ import annotations

import html
import json
import math
import os
from typing import Any

import numpy as np

ENV = "KVEXPLORE_INSPECT"


def plain(v: Any) -> Any:
    """``v`` with numpy arrays and scalars as lists and numbers, NaN as None (JSON has no NaN)."""
    if isinstance(v, np.ndarray):
        v = v.tolist()
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (float, np.floating)):
        return None if math.isnan(v) else float(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.bool_):
        return bool(v)
    return v


def state(explorer: Any) -> dict[str, Any]:
    """What ``explorer`` holds, as JSON-safe data."""
    return {"specs": {name: {"traces": plain(s.traces), "layout": plain(s.layout)}
                      for name, s in explorer.specs().items()},
            "compare": explorer.compare_rows(), "view": explorer.view, "error": explorer.error,
            "operations": explorer.operations,
            "tokens": len(explorer.lane.generator.tokens), "lane": explorer.lane.name, "shown": explorer.shown(),
            "press": press(explorer), "speculation": speculation(explorer)}


def speculation(explorer: Any) -> dict[str, Any] | None:
    """What the shown lane's generator counted of its verifications (``generator.speculation``, not a record):
    per verification the step of its last token, drafted and accepted; and the tokens generated (None: the lane
    does not draft)."""
    lane = explorer.lane
    spec = lane.speculation
    if spec is None:
        return None
    return {"verifications": [{"last_step": v.first_step + len(v.tokens) - 1, "drafted": len(v.drafted),
                               "accepted": v.accepted} for v in spec.verifications],
            "generated": max(0, len(lane.history) - 1)}


def press(explorer: Any) -> dict[str, Any] | None:
    """What the shown lane's cache holds, read from the cache itself (not from a record), when it presses: the
    chosen layer's last press scores (an infinite score as None) and choice, every pressed layer's kept mask, its
    length and its bytes (what the press views must draw)."""
    lane = explorer.lane
    cache = lane.cache
    eviction = cache.eviction
    if eviction is None or not lane.history:
        return None
    layer = explorer.layer
    got = eviction.press_scores(layer) if layer in cache.full_layers else None
    scores = None if got is None else got[0].numpy()
    report = cache.inspect.memory_report()
    return {"layer": layer, "length": cache.length, "reserved_bytes": report.reserved_bytes,
            "used_bytes": report.logical_bytes,
            "scores": None if got is None else plain(np.where(np.isfinite(scores), scores, np.nan)),
            "kept": None if got is None else got[1].int().tolist(),
            "held": {str(layer): [len(p) for p in eviction.kept_positions(layer)] for layer in cache.full_layers},
            "kept_mask": {str(layer): eviction.kept_mask(layer).int().tolist() for layer in cache.full_layers}}


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def element():
    """The hidden element that carries :func:`state` (None unless ``KVEXPLORE_INSPECT`` is set)."""
    if not enabled():
        return None
    import ipywidgets as W

    box = W.HTML(layout=W.Layout(display="none"))
    box.add_class("kvx-truth")
    return box


def publish(box: Any, explorer: Any) -> None:
    if box is not None:
        put(box, state(explorer))


def put(box: Any, data: dict[str, Any]) -> None:
    """Put ``data`` (JSON-safe, see :func:`plain`) into ``box`` (see :func:`element`), as any widget's state."""
    box.value = f"<pre>{html.escape(json.dumps(data))}</pre>"
