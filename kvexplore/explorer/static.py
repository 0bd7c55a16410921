"""An explorer's static copy in a notebook: what ``jupyter nbconvert --to html`` and GitHub's viewer show when there
is no kernel to drive the widget.

Displayed after the widget: plain HTML with the token strip and the comparison table, then the replay of the steps so
far (:func:`kvexplore.views.page.fragment`), brought up to date after every cell that changed the session
(IPython's ``post_run_cell``). A live page empties it (its first figure tells the kernel) or, where that update never
comes (Voila), it hides itself; plotly.js travels once per notebook, in the first copy that holds a replay. See
docs/explorer.md ("Sharing a session").
"""

from __future__ import annotations

import html
from typing import Any

from ..views import assets, compare
from ..views.page import fragment

_plotly_owner: int | None = None  # id() of the StaticCopy whose replay carries plotly.js


class StaticCopy:
    def __init__(self, explorer: Any) -> None:
        self.explorer = explorer
        self.live = False  # a frontend drew the widget: the copy is not needed
        self._handle = self._key = self._shell = None

    def show(self) -> None:
        """Display the copy under the widget (once per explorer; later displays of it reuse the output)."""
        try:
            from IPython import get_ipython
            from IPython.display import HTML, display
        except ImportError:  # pragma: no cover - IPython comes with the notebook extra
            return
        shell = get_ipython()
        if shell is None or self.live:
            return
        if self._handle is None:
            self._handle = display(HTML(self.html()), display_id=True)
            self._key = self._state()
            self._shell = shell
            shell.events.register("post_run_cell", self.refresh)
        else:
            self.refresh()

    def refresh(self, *_: Any) -> None:
        """Redraw the copy if the session changed since it was last drawn."""
        if self._handle is None or self.live:
            return
        key = self._state()
        if key != self._key:
            from IPython.display import HTML

            self._key = key
            self._handle.update(HTML(self.html()))

    def on_message(self, _widget, content, _buffers) -> None:
        """A message from the widget's first figure: "rendered" when a frontend drew it."""
        if isinstance(content, dict) and content.get("event") == "rendered":
            self.on_live_view()

    def on_live_view(self) -> None:
        """The widget was drawn by a frontend: empty the copy and stop updating it."""
        if self.live:
            return
        self.live = True
        if self._handle is not None:
            from IPython.display import HTML

            self._handle.update(HTML(""))
        if self._shell is not None:
            try:
                self._shell.events.unregister("post_run_cell", self.refresh)
            except ValueError:
                pass

    def _state(self) -> tuple:
        ex = self.explorer
        lanes = tuple((name, len(lane.history), id(lane.history[-1]) if lane.history else 0)
                      for name, lane in ex.session.lanes.items())
        return lanes, ex.layer, ex.head, ex.lane.name

    def html(self) -> str:
        """The copy: a plain-HTML summary, then the replay of the steps so far."""
        global _plotly_owner
        ex = self.explorer
        runs = ex.session.runs()
        intro = (f"<p><b>kvexplore explorer</b> · {html.escape(ex.model.source or 'model')} · strategies "
                 f"{html.escape(', '.join(ex.session.lanes))} · a static copy for pages without a kernel "
                 f"(run the notebook for the live widget)</p>")
        if not runs:
            return f'<div class="kvx-static">{intro}<p>no steps yet</p></div>'
        lane = ex.lane
        strip = ex.token_strip.html(ex.model.tokenizer, lane.generator, ex.divergence_mark(lane))
        snap = ex.snapshot()
        table = compare.table_html(compare.rows_from_snapshot(snap), compare.notes_from_snapshot(snap))
        if _plotly_owner is None:
            _plotly_owner = id(self)
        replay = fragment(runs, ex.layer, ex.head, title=f"replay of the {max(len(r) for r in runs.values())} steps "
                          f"so far · layer {ex.layer}, head {ex.head}", plotly=_plotly_owner == id(self))
        return (f'<div class="kvx-static">{intro}<p>{html.escape(lane.name)}:</p>{strip}{table}{replay}'
                f'<script>{_HIDE_WHEN_LIVE}</script></div>')


# the copy hides itself where a live figure has drawn (a page that never gets the kernel's update: Voila)
_HIDE_WHEN_LIVE = assets.text(__file__, "static_hide.js")
