"""A recorded run as one self-contained HTML file: a step slider and play/pause that replay the token strip, every
registered view drawn per lane (the cache map with its write and read windows, the attention of one layer and head)
and the views of the whole run (the memory lines). It needs no kernel and no network (plotly.js is inside the file).

The page is built by the drawing layer (:mod:`kvexplore.views.page`, the frames by :mod:`kvexplore.views.frames`),
which an explorer's ``save_html`` and a notebook's static copy use too; this module is the replay's public face
(``kvexplore.replay.save_html``, ``kvexplore export TRACE -o demo.html``, ``history.save_html(path)``).
"""

from __future__ import annotations

from ..views.frames import ArrayStore, frames, model_info, snapshot_at
from ..views.page import fragment, save_html

__all__ = ["ArrayStore", "fragment", "frames", "model_info", "save_html", "snapshot_at"]
