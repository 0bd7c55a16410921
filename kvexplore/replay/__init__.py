"""The HTML replay: a run's steps in one self-contained page (``kvexplore replay`` and :func:`save_html`)."""

from .page import fragment, frames, model_info, save_html, snapshot_at

__all__ = ["fragment", "frames", "model_info", "save_html", "snapshot_at"]
