"""The explorer's controls: every ipywidget, named and classed, and how they are laid out. The explorer wires
them to its operations (:mod:`.widget`)."""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from ..store import MODELS

BUTTONS = ("prefill", "step", "run", "rewind", "reset", "fork", "load")  # disabled while an operation runs


def make(config: ModelConfig, lanes: list[str], layer: int, head: int, settings: dict[str, Any], prompt: str,
         chat: bool, has_chat: bool, source: str | None) -> dict[str, Any]:
    """Every control, by name, each with its CSS class ``kvx-<name>`` (what the browser tests find)."""
    import ipywidgets as W

    c = config
    w: dict[str, Any] = {}

    def button(name: str, text: str, tip: str, style: str = "") -> W.Button:
        b = W.Button(description=text, tooltip=tip, button_style=style, layout=W.Layout(width="auto"))
        b.add_class(f"kvx-{name}")
        w[name] = b
        return b

    w["prompt"] = W.Textarea(value=prompt, placeholder="Type a prompt, then press Prefill",
                             layout=W.Layout(width="100%", height="3.2em"))
    w["chat"] = W.Checkbox(value=chat, description="chat template", indent=False,
                           layout=W.Layout(width="auto", display="" if has_chat else "none"))
    button("prefill", "Prefill", "run the whole prompt through every strategy", "primary")
    button("step", "Step", "one token on every strategy", "success")
    button("run", "Run", "this many steps (stops at end of sequence)")
    button("rewind", "Rewind", "forget this many tokens (slots turn stale)", "warning")
    button("reset", "Reset", "empty every cache")
    button("fork", "Fork", "a second sequence from here (paged caches share pages)")
    w["run_n"] = W.BoundedIntText(value=16, min=1, max=100000, layout=W.Layout(width="5.5em"))
    w["rewind_n"] = W.BoundedIntText(value=1, min=0, max=100000, layout=W.Layout(width="4.5em"))
    wide = {"description_width": "initial"}
    names = list(MODELS)
    src = source if source in MODELS else None
    w["model"] = W.Dropdown(options=names, value=src or names[0], description="model", style=wide,
                            layout=W.Layout(width="15em"))
    button("load", "Load", "load the chosen model and start over")
    w["lane"] = W.Dropdown(options=lanes, description="strategy", style=wide, layout=W.Layout(width="18em"))
    w["layer"] = W.Dropdown(options=list(range(c.num_layers)), value=layer, description="layer", style=wide,
                            layout=W.Layout(width="8em"))
    w["head"] = W.Dropdown(options=list(range(c.num_heads)), value=head, description="head", style=wide,
                           layout=W.Layout(width="8em"))
    s = settings
    w["temperature"] = W.BoundedFloatText(value=s["temperature"], min=0, max=10, step=0.1, style=wide,
                                          description="temperature", layout=W.Layout(width="13em"))
    w["top_k"] = W.BoundedIntText(value=s["top_k"] or 0, min=0, max=1000000, description="top-k (0 = off)",
                                  style=wide, layout=W.Layout(width="13em"))
    w["top_p"] = W.BoundedFloatText(value=s["top_p"] or 1.0, min=0.01, max=1, step=0.05, description="top-p",
                                    style=wide, layout=W.Layout(width="10em"))
    w["seed"] = W.IntText(value=s["seed"], description="seed (next prefill)", style=wide,
                          layout=W.Layout(width="14em"))
    w["progress"] = W.IntProgress(value=0, min=0, max=1, description="", layout=W.Layout(visibility="hidden",
                                                                                    width="20em"))
    w["status"] = W.HTML()
    w["error"] = W.HTML()
    w["tokens"] = W.HTML(layout=W.Layout(width="100%"))
    w["compare"] = W.HTML()
    for name in ("prompt", "chat", "run_n", "rewind_n", "model", "lane", "layer", "head", "temperature", "top_k",
                 "top_p", "seed", "progress", "status", "error", "tokens", "compare"):
        w[name].add_class(f"kvx-{name.replace('_', '-')}")
    return w


def arrange(w: dict[str, Any]):
    """The explorer's root box (class ``kvx-explorer``) and the box the figures go in."""
    import ipywidgets as W

    def row(*items):
        return W.HBox(list(items), layout=W.Layout(flex_flow="row wrap", align_items="center"))

    figure_box = W.VBox()
    root = W.VBox([
        row(w["model"], w["load"], w["progress"]),
        row(w["prompt"]),
        row(w["chat"], w["prefill"], w["step"], w["run"], w["run_n"], w["rewind"], w["rewind_n"], w["reset"], w["fork"]),
        row(w["lane"], w["layer"], w["head"], w["temperature"], w["top_k"], w["top_p"], w["seed"]),
        w["status"], w["error"], w["tokens"], figure_box,
    ], layout=W.Layout(width="100%"))
    root.add_class("kvx-explorer")
    return figure_box, root
