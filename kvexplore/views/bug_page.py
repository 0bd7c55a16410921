"""A zoo bug's replay: its broken run beside its fixed twin in one self-contained page (``kvexplore bugs run NAME
--html FILE``), the first divergence marked on the slider; a prefix bug's two pools side by side under one slider."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .page import save_html
from .prefix_page import save_prefix_html

BROKEN, FIXED = "bug planted", "fixed twin"


def save_bug_html(reproduction: Any, path: str | Path, title: str | None = None) -> Path:
    """Write the replay of ``reproduction`` (:func:`kvexplore.bugs.reproduce`) to ``path``."""
    bug, d = reproduction.bug, reproduction.first_divergence
    title = title or f"kvexplore · bug zoo · {bug.name} ({bug.reference})"
    if reproduction.broken.unit == "request":
        return save_prefix_html({BROKEN: reproduction.broken.subject, FIXED: reproduction.fixed.subject}, path,
                                title=title)
    marks = {} if d is None else {d.index: f"first divergence: {d}"}
    runs = {BROKEN: reproduction.broken.records(), FIXED: reproduction.fixed.records()}
    layer = d.layer if d is not None and d.layer is not None else 0
    return save_html(runs, path, layer=layer, title=title, marks=marks, side_by_side=True)
