"""One prefix cache's replay page, or several pools' side by side, written to a file: what
``PrefixPool.save_html`` and ``kvexplore kv-events --html`` write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..prefix.page_writer import register_page_writer
from ..views.page import document
from .prefix_compare_page import compare_fragment, several
from .prefix_page import prefix_fragment


def save_prefix_html(source: Any, path: str | Path, title: str | None = None) -> Path:
    """Write the replay of ``source``'s frames (a :class:`~kvexplore.prefix.pool.PrefixPool`, anything with
    ``frames()``, or a list of :class:`~kvexplore.prefix.frames.PoolFrame`) to ``path``: one self-contained file.
    Several pools (a ``{name: pool}`` mapping or a list of pools that served the same requests) are drawn side by
    side under one slider (:mod:`.prefix_compare_page`)."""
    path = Path(path)
    body = compare_fragment(source, title) if several(source) else prefix_fragment(source, title)
    path.write_text(document(body, title or "kvexplore · prefix cache"), encoding="utf-8")
    return path


register_page_writer(save_prefix_html)  # PrefixPool.save_html (the prefix folder sits below this one)
