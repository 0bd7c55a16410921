"""Where ``save_html`` of a pool or an event replay finds its page writer: the drawing layer registers it when
imported, as for ``History.save_html`` (:func:`kvexplore.trace.files.register_html_writer`)."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from pathlib import Path

from ..errors import StateError

PageWriter = Callable[..., Path]  # (a source of frames, path, title=) -> the path written
_writer: PageWriter | None = None


def register_page_writer(write: PageWriter) -> None:
    global _writer
    if not callable(write):
        raise TypeError(f"a page writer must be callable, got {type(write).__name__}")
    _writer = write


def write_page(source, path: str | Path, title: str | None = None) -> Path:
    if _writer is None:
        import_module("kvexplore.views.prefix_page")  # the drawing layer registers its writer (loaded on first use)
    if _writer is None:
        raise StateError("no prefix page writer is registered: import kvexplore.replay first")
    return _writer(source, path, title=title)
