"""The HTML replay's public face: a run's steps in one self-contained page (``kvexplore export`` and :func:`save_html`),
a prefix cache's history (:func:`save_prefix_html`) and a zoo bug's two runs (:func:`save_bug_html`). The pages are
drawn by the drawing layer (:mod:`kvexplore.views.page`, :mod:`kvexplore.views.prefix_page`), which an explorer's
``save_html`` and a notebook's static copy use too."""

from ..views.frames import ArrayStore, frames, model_info, snapshot_at
from ..views.bug_page import save_bug_html
from ..views.page import fragment, save_html
from ..views.prefix_page import prefix_fragment, save_prefix_html

__all__ = ["ArrayStore", "fragment", "frames", "model_info", "prefix_fragment", "save_bug_html", "save_html",
           "save_prefix_html", "snapshot_at"]
