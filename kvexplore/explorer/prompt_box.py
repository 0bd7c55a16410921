"""The prompt box: a text area whose text the kernel always has when a button that reads it is clicked (why an
ipywidgets ``Textarea`` does not: docs/explorer.md, "Controls").

The page sends the text with the click: a click on one of the buttons named in ``clicks`` (Prefill, Step, Run),
inside the same explorer, is taken by this box, which sends ``{"value": text, "n": stamp, "click": name}``; the kernel
sets the text and clicks the button itself. Each edit is sent too, stamped; the kernel takes an edit only when it is
newer than the newest it took. The page ignores the kernel's echo of a text it sent itself; a value the kernel sets
on its own (a prompt of token ids, the app's prompt) replaces the text. The page's side is ``prompt_box.js``.
"""

from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from ..views import assets


class PromptBox(anywidget.AnyWidget):
    """A multi-line text box (``value``, ``placeholder``) whose text reaches the kernel with every click on the
    buttons given to :meth:`reads_on` (and with every edit, newest first)."""

    _esm = assets.path(__file__, "prompt_box.js")  # the box's view
    value = traitlets.Unicode("").tag(sync=True)
    placeholder = traitlets.Unicode("").tag(sync=True)
    clicks = traitlets.List(traitlets.Unicode()).tag(sync=True)  # the buttons' names (their class is kvx-<name>)

    def __init__(self, value: str = "", placeholder: str = "", **kwargs) -> None:
        super().__init__(value=value, placeholder=placeholder, **kwargs)
        self._buttons: dict[str, Any] = {}
        self._newest = float("-inf")  # the stamp of the newest edit taken
        self.on_msg(self._message)

    def reads_on(self, buttons: dict[str, Any]) -> None:
        """Buttons (by name, each with the CSS class ``kvx-<name>``) whose clicks on the page come with the text."""
        self._buttons = dict(buttons)
        self.clicks = list(buttons)

    def _message(self, _widget, content, _buffers) -> None:
        if not isinstance(content, dict) or not isinstance(content.get("value"), str):
            return
        stamp = content.get("n")
        if not isinstance(stamp, (int, float)) or isinstance(stamp, bool):
            self.value = content["value"]
        elif stamp > self._newest:  # an edit older than one already taken (handled late) leaves the newer text
            self._newest = stamp
            self.value = content["value"]
        button = self._buttons.get(content.get("click"))
        if button is not None:
            button.click()
