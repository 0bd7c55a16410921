"""The HTML replay: a run's steps in one self-contained page (``kvexplore replay`` and :func:`save_html`)."""

from .bug_page import save_bug_html
from .page import fragment, frames, model_info, save_html, snapshot_at
from .prefix_page import prefix_fragment
from .prefix_save import save_prefix_html

__all__ = ["fragment", "save_bug_html", "frames", "model_info", "prefix_fragment", "save_html", "save_prefix_html",
           "snapshot_at"]
