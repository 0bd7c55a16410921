"""Links to a moment of ``kvexplore app``: the page's address carries what is on the screen (``?model=tiny&strategies=
preallocated,paged&prompt=Call+me+Ishmael.&steps=12&lane=paged&layer=3&head=1&tab=attention``), Voila hands it to the
page's kernel (``QUERY_STRING``), and the app rebuilds that view: the model and lanes, the prompt prefilled (``chat``:
through the chat template), the steps run (greedy, as the app starts), the lane (and ``with``, the one drawn side by
side), layer, head and tab picked. The page's "link to this view" button writes the link of what it shows."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlencode

from ..errors import SettingsError

#: what a link may carry: the app's arguments (as ``kvexplore app`` takes them), then where the view stands
BUILD = ("model", "strategies", "max_seq_len", "prompt", "chat")
VIEW = ("steps", "lane", "with", "layer", "head", "tab", "presentation")  # with: the lane drawn side by side
KEYS = BUILD + VIEW


def parse(query: str) -> dict[str, str]:
    """A page's query string as the link's settings (each key once); an unknown key is refused naming the keys."""
    found = parse_qs(query or "", keep_blank_values=True)
    if unknown := sorted(set(found) - set(KEYS)):
        raise SettingsError(f"the page's address has {unknown[0]!r}, which a link to the app does not carry: it takes "
                            f"{', '.join(KEYS)} (the 'link to this view' button writes one)")
    return {key: values[-1] for key, values in found.items()}


def on(link: Mapping[str, str], key: str) -> bool:
    """Whether the link turns ``key`` on (``1``, ``true``, ``yes``, ``on``)."""
    return link.get(key, "").lower() in ("1", "true", "yes", "on")


def _number(link: Mapping[str, str], key: str, low: int, high: int | None, what: str) -> int | None:
    if key not in link:
        return None
    text = link[key]
    if not text.isdigit() or int(text) < low or (high is not None and int(text) > high):
        span = f"{low}..{high}" if high is not None else f"{low} or more"
        raise SettingsError(f"the link's {key}={text!r}: {what} is a whole number in {span}")
    return int(text)


def apply(explorer, link: Mapping[str, str]) -> None:
    """Put ``explorer`` (built and prefilled from the link's model, lanes and prompt) where the link stands: run its
    steps, pick its lane, layer, head, tab and presentation. A value the explorer cannot show is refused naming the
    ones it can."""
    c = explorer.model.config
    steps = _number(link, "steps", 0, 100_000, "the steps to run after the prefill")
    layer = _number(link, "layer", 0, c.num_layers - 1, f"a layer of this model (it has {c.num_layers})")
    head = _number(link, "head", 0, c.num_heads - 1, f"a query head of this model (it has {c.num_heads})")
    for key in ("lane", "with"):
        if key in link and link[key] not in explorer.lanes:
            raise SettingsError(f"the link's {key}={link[key]!r} is not a lane of this page: "
                                f"{', '.join(explorer.lanes)}")
    lane = link.get("lane")
    if steps:
        explorer.run(steps)
    w = explorer.controls
    if lane is not None:
        w["lane"].value = lane
    if "with" in link:
        explorer.side_by_side = link["with"]
    if layer is not None:
        w["layer"].value = layer
    if head is not None:
        w["head"].value = head
    if "tab" in link:
        explorer.view = link["tab"]
    if "presentation" in link:
        explorer.presentation = on(link, "presentation")


def of(explorer, settings: Mapping[str, Any]) -> str:
    """The query string of what ``explorer`` shows now (``settings``: the app's model, lanes and caches' size)."""
    session = explorer.session
    done = max(len(session.tokens) - len(session.prompt_tokens) - 1, 0) if session.tokens else 0
    w = explorer.controls
    query = {"model": settings["source"], "strategies": ",".join(explorer.lanes),
             "max_seq_len": settings["max_seq_len"], "prompt": w["prompt"].value, "steps": done,
             "lane": w["lane"].value, "layer": w["layer"].value, "head": w["head"].value, "tab": explorer.view}
    if explorer.side_by_side:
        query["with"] = explorer.side_by_side
    if w["chat"].value:
        query["chat"] = 1
    if explorer.presentation:
        query["presentation"] = 1
    return urlencode(query)


def button(explorer, settings: Mapping[str, Any], page: str):
    """The "link to this view" button and the line it writes the link in (``page``: the page's path on the server,
    Voila's ``SCRIPT_NAME``)."""
    import ipywidgets as W

    press = W.Button(description="link to this view", tooltip="write the address that opens the app at this view",
                     layout=W.Layout(width="auto"))
    press.add_class("kvx-app-link-button")
    line = W.HTML(layout=W.Layout(margin="0 0 0 8px"))
    line.add_class("kvx-app-link")

    def write(_=None) -> None:
        address = f"{page}?{of(explorer, settings)}"
        line.value = f'<a href="{html.escape(address)}">{html.escape(address)}</a>'

    press.on_click(write)
    return W.HBox([press, line])
