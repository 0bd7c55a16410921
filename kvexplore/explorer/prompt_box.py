"""The prompt box: a text area whose text the kernel always has when a button that reads it is clicked.

Two things stood between a typed prompt and the click after it. An ipywidgets ``Textarea`` holds an edit back while
an earlier one is unanswered, while a button's click goes out at once; and ipykernel (7) dispatches a comm message
that arrives while another one is being handled without waiting its turn, so even messages sent in order can be
handled out of order on a busy kernel. A teacher who typed a prompt and pressed Prefill got the prompt as it was a
few keystrokes earlier.

So the page sends the text with the click: a click on one of the buttons named in ``clicks`` (Prefill, Step, Run),
inside the same explorer, is taken by this box, which sends ``{"value": text, "n": stamp, "click": name}``; the kernel
sets the text and clicks the button itself (the explorer's handlers run as for any click). Each edit is sent too,
stamped; the kernel takes an edit only when it is newer than the newest it took, so a late one cannot bring back an
old text. The kernel's answer (the value it set) comes back to the page as an echo, which the box ignores when it is
a text it sent itself (the user may have typed on since); a value the kernel sets on its own (a prompt of token ids,
the app's prompt) replaces the text.
"""

from __future__ import annotations

from typing import Any

import anywidget
import traitlets

_ESM = """
function render({ model, el }) {
  const box = document.createElement("textarea");
  box.className = "widget-input kvx-prompt-text";
  box.placeholder = model.get("placeholder");
  box.value = model.get("value");
  box.rows = 2;
  box.style.cssText = "width: 100%; height: 100%; box-sizing: border-box; resize: vertical;";
  const sent = [];  // texts sent to the kernel whose echo has not come back
  let last = 0;
  const send = (extra) => {  // stamps increase across this page's views (microseconds since the epoch)
    last = Math.max(last + 1, Math.floor((performance.timeOrigin + performance.now()) * 1000));
    model.send({ value: box.value, n: last, ...extra });
  };
  box.addEventListener("input", () => {
    if (sent[sent.length - 1] !== box.value) sent.push(box.value);
    send({});
  });
  const clicked = (event) => {  // a click on a button that reads the prompt: sent with the text, in one message
    const button = event.target instanceof Element ? event.target.closest("button") : null;
    if (!button || button.disabled) return;
    const name = model.get("clicks").find((b) => button.classList.contains("kvx-" + b));
    const root = button.closest(".kvx-explorer");
    if (!name || !root || !root.contains(el)) return;
    event.stopPropagation();
    event.preventDefault();
    send({ click: name });
  };
  document.addEventListener("click", clicked, true);
  const changed = () => {
    const value = model.get("value");
    const i = sent.indexOf(value);
    if (i >= 0) {
      sent.splice(0, i + 1);  // the kernel took this text from this box: what the user typed since stays
      return;
    }
    if (box.value !== value) box.value = value;
  };
  model.on("change:value", changed);
  el.classList.add("widget-textarea");
  el.appendChild(box);
  return () => {
    model.off("change:value", changed);
    document.removeEventListener("click", clicked, true);
  };
}
export default { render };
"""


class PromptBox(anywidget.AnyWidget):
    """A multi-line text box (``value``, ``placeholder``) whose text reaches the kernel with every click on the
    buttons given to :meth:`reads_on` (and with every edit, newest first)."""

    _esm = _ESM
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
