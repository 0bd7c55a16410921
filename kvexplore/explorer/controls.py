"""The explorer's controls: every ipywidget, named and classed, and how they are laid out on one 1280 x 800 screen
(docs/explorer.md, "Screen layout"). The explorer wires them to its operations (:mod:`.widget`). Presentation hides
what a class does not need, draws bigger and shows one figure at a time at the full width, the cache map as the first
tab (:data:`MAP_TAB`).
"""

from __future__ import annotations

import html
import math
from contextlib import contextmanager
from typing import Any

from ..config.model_config import ModelConfig
from ..views import assets, map_rows
from ..views.cache_map import LEGEND_PX
from ..views.lettering import CHAR, at_least, fit_notes, fit_title
from ..formats.store import MODELS

HEIGHT = 410  # pixels: the cache map and the tab's view side by side fit a 1280 x 800 screen under the controls
BUTTONS = ("prefill", "step", "run", "rewind", "reset", "fork", "load")  # disabled while an operation runs
HIDDEN_WHEN_PRESENTING = ("settings", "fork")
COLUMN_PX = 430  # what titles wrap to: a figure's width beside another at 1280 x 800 in JupyterLab, files open
PRESENTING_PX = 18  # the smallest text when presenting (titles 2 px more)
STEP_TIP = "one token on every strategy (prefills the prompt first if nothing has run)"
CONTINUE_TIP = "the model has finished (end of sequence): one more token past it on every strategy"
# pixels: a figure's height when presenting, one at a time under the controls at 18 px (which take about 340 px of a
# 1280 x 800 screen, the header's second sentence ``kvx-header-more`` hidden; the stored keys' rows need 440)
PRESENTING_HEIGHT = 440
PRESENTING_COLUMN_PX = 2 * COLUMN_PX  # what titles wrap to when presenting: the full width
TABLE_ROW_PX, COMPARE_PX = 26, 240  # presenting: a row of the compare table; its figure's height at least
PANEL_PX = 150  # presenting: what a memory panel past the second adds to the figure (past one screen: 18 px needs it)
# side by side: the column's room for both maps under the controls at 1280 x 800, and a plot's height at least (long
# titles, a quantized lane's with its drift, take the column a little past the screen rather than squeeze the maps)
TWO_MAPS_PX, MAP_PLOT_PX = 500, 110
UNDER_AXIS_PX, LEGEND_ROW_PX = 64, 28  # presenting: an axis' tick labels and title; a row of a legend
MAP_TAB = ("Cache map", "cache_map")  # presenting, the cache map is a tab, the first
# the page's type when presenting: every control, label, table and text of the explorer at PRESENTING_PX at least
# (ipywidgets size their controls from these variables); controls.css, with __PRESENTING_PX__ for that size
_CSS = assets.text(__file__, "controls.css").replace("__PRESENTING_PX__", f"{PRESENTING_PX}px")
STYLE = f"<style>\n{_CSS}</style>"


def make(config: ModelConfig, lanes: list[str], layer: int, head: int, sampling: Any, seed: int, prompt: str,
         chat: bool, has_chat: bool, running: tuple[str, str], tabs: list[tuple[str, str]], view: str,
         presentation: bool) -> dict[str, Any]:
    """Every control, by name, each with its CSS class ``kvx-<name>`` (what the browser tests find)."""
    import ipywidgets as W

    from .prompt_box import PromptBox

    c = config
    w: dict[str, Any] = {}
    wide = {"description_width": "initial"}

    def button(name: str, text: str, tip: str, style: str = "") -> None:
        w[name] = W.Button(description=text, tooltip=tip, button_style=style, layout=W.Layout(width="auto"))

    w["prompt"] = PromptBox(value=prompt, placeholder="Type a prompt, then press Prefill (or Step)",
                             layout=W.Layout(flex="1 1 18em", min_width="14em", height="2.6em"))
    w["chat"] = W.Checkbox(value=chat, description="chat template", indent=False,
                           layout=W.Layout(width="auto", display="" if has_chat else "none"))
    button("prefill", "Prefill", "run the whole prompt through every strategy", "primary")
    button("step", "Step", STEP_TIP, "success")
    button("run", "Run", "this many steps (stops at end of sequence)")
    button("rewind", "Rewind", "forget this many tokens (slots turn stale)", "warning")
    button("reset", "Reset", "empty every cache")
    button("fork", "Fork", "a second sequence from here (paged caches share pages)")
    w["prompt"].reads_on({name: w[name] for name in ("prefill", "step", "run")})  # clicks that read the prompt
    w["run_n"] = W.BoundedIntText(value=16, min=1, max=100000, layout=W.Layout(width="5em"))
    w["rewind_n"] = W.BoundedIntText(value=1, min=0, max=100000, layout=W.Layout(width="4.5em"))
    w["model"] = W.Dropdown(description="model", style=wide, layout=W.Layout(width="15em"))  # smollm2-135m whole
    name_model(w["model"], running)
    button("load", "Load", "load the chosen model and start over")
    w["lane"] = W.Dropdown(options=lanes, description="strategy", style=wide, layout=W.Layout(width="17em"))
    w["layer"] = W.Dropdown(options=list(range(c.num_layers)), value=layer, description="layer", style=wide,
                            layout=W.Layout(width="7.5em"))
    w["head"] = W.Dropdown(options=list(range(c.num_heads)), value=head, description="head", style=wide,
                           layout=W.Layout(width="7.5em"))
    w["side_by_side"] = W.Checkbox(value=False, description="side by side", indent=False,
                                   layout=W.Layout(width="auto"))
    w["lane_b"] = W.Dropdown(options=lanes, value=lanes[1] if len(lanes) > 1 else lanes[0], description="with",
                             style=wide, layout=W.Layout(width="15em", display="none"))
    w["presentation"] = W.Checkbox(value=presentation, description="presentation", indent=False,
                                   layout=W.Layout(width="auto"))
    w["temperature"] = W.BoundedFloatText(value=sampling.temperature, min=0, max=10, step=0.1, style=wide,
                                          description="temperature", layout=W.Layout(width="10.5em"))
    w["top_k"] = W.BoundedIntText(value=sampling.top_k or 0, min=0, max=1000000, description="top-k (0 = off)",
                                  style=wide, layout=W.Layout(width="10.5em"))
    w["top_p"] = W.BoundedFloatText(value=sampling.top_p or 1.0, min=0.01, max=1, step=0.05, description="top-p",
                                    style=wide, layout=W.Layout(width="7.5em"))
    w["seed"] = W.IntText(value=seed, description="seed", style=wide, layout=W.Layout(width="7.5em"))
    w["progress"] = W.IntProgress(value=0, min=0, max=1, description="", layout=W.Layout(display="none",
                                                                                    width="12em", flex="0 0 auto"))
    w["view"] = W.ToggleButtons(options=tabs, value=view, style={"button_width": "auto"},
                                tooltips=[f"show {t} beside the cache map" for t, _ in tabs])
    w["status"] = W.HTML()
    w["error"] = W.HTML()
    w["tokens"] = W.HTML(layout=W.Layout(width="auto"))  # the row's width less its margins (100% ran past the edge)
    w["compare"] = W.HTML()
    w["style"] = W.HTML(STYLE, layout=W.Layout(display="none"))
    for name, widget in w.items():
        widget.add_class(f"kvx-{name.replace('_', '-')}")
    return w


def arrange(w: dict[str, Any], figures: dict[str, Any], loader: Any):
    """The explorer's root box (class ``kvx-explorer``), the settings row, the left column (cache maps) and the
    right panel (the tab's view)."""
    import ipywidgets as W

    def row(*items, **kw):
        return W.HBox(list(items), layout=W.Layout(**{"flex_flow": "row wrap", "align_items": "center", **kw}))

    def named(name: str, widget: Any) -> Any:
        widget.add_class(f"kvx-{name}")
        w[name] = widget
        return widget

    settings = named("settings", row(w["model"], w["load"], w["temperature"], w["top_k"], w["top_p"], w["seed"]))
    left = named("left", W.VBox([figures["cache_map"], figures["cache_map_b"]],
                                layout=W.Layout(flex="1 1 360px", min_width="330px")))
    named("maps", W.HBox([], layout=W.Layout(width="100%")))  # presenting: the cache maps as a tab, next to each other
    panel = W.VBox([], layout=W.Layout(width="100%"))
    right = named("right", W.VBox([w["view"], panel], layout=W.Layout(flex="1 1 360px", min_width="330px")))
    main = row(left, right, align_content="flex-start")
    main.layout.align_items = "flex-start"
    root = W.VBox([
        row(w["prompt"], w["chat"], w["prefill"], w["step"], w["run"], w["run_n"], w["rewind"], w["rewind_n"],
            w["reset"], w["fork"]),
        row(w["lane"], w["layer"], w["head"], w["side_by_side"], w["lane_b"], w["presentation"]),
        settings,
        # the bar, while an operation runs, before its words
        row(w["progress"], w["status"], flex_flow="row nowrap", width="100%"),
        w["error"], w["tokens"], main, loader, w["style"],
    ], layout=W.Layout(width="100%"))
    root.add_class("kvx-explorer")
    return root, panel


def columns(w: dict[str, Any], figures: dict[str, Any], presenting: bool) -> None:
    """The cache map on the left and the tab's view beside it, or, presenting, the tab's view alone at the full width
    (18 px type needs it), the cache maps moved to the row shown by the cache map's tab."""
    maps = [figures["cache_map"], figures["cache_map_b"]]
    w["left"].layout.display = "none" if presenting else ""
    w["right"].layout.flex = "1 1 100%" if presenting else "1 1 360px"
    w["left"].children, w["maps"].children = ([], maps) if presenting else (maps, [])
    for fig in maps:
        fig.layout.flex = "1 1 0" if presenting else ""
        fig.layout.min_width = "0" if presenting else ""


def fit(name: str, spec: Any, side_by_side: bool, presenting: bool) -> Any:
    """``spec`` as drawn on this screen: its height for the one-screen layout (presenting, one figure at a time under
    the controls), its title wrapped to the width a figure has (the top margin following its lines), and every text
    at :data:`PRESENTING_PX` at least when presenting, its axes labelled as often as that type has room."""
    full = PRESENTING_HEIGHT if presenting else HEIGHT
    height = full
    panels = sum(1 for k in spec.layout if k.startswith("yaxis") and "domain" in spec.layout[k])
    if presenting and name == "memory" and panels > 2:  # a third panel (layer kinds) gets room of its own
        height += PANEL_PX * (panels - 2)
    if name == "compare":  # the compare table sits above its figure: a row per lane (18 px type: taller rows)
        lanes = len({t.get("legendgroup") for t in spec.traces if t.get("legendgroup")})
        height = max(COMPARE_PX, full - 60 - TABLE_ROW_PX * (lanes + 1)) if presenting else full - 130
    two_maps = name == "cache_map_b" or (name == "cache_map" and side_by_side)
    if two_maps and not presenting:  # one above the other (balance gives each its height)
        height = full // 2 + (0 if name == "cache_map_b" else 90)
    if name == "cache_map_b":  # the first map's legend says it for both, so no legend and none of its room (never
        spec.layout["showlegend"] = False  # shown here: plotly keeps the room of a legend once drawn, then hidden)
        spec.layout["margin"] = {**spec.layout["margin"], "b": spec.layout["margin"]["b"] - LEGEND_PX}
    spec.layout["height"] = height
    floor = PRESENTING_PX if presenting else None
    column = (COLUMN_PX * 1.3 if two_maps else PRESENTING_COLUMN_PX) if presenting else COLUMN_PX
    fit_title(spec.layout, column, floor + 2 if floor else None)
    if presenting:  # read from the back of a lecture hall
        spec.layout["font"] = dict(size=PRESENTING_PX)
        legend = spec.layout.get("legend")
        if isinstance(legend, dict) and legend.get("yanchor") == "top" and legend.get("y", 0) < 0:
            # a legend under the plot: at the figure's foot, the margin its rows and the axis' bigger ticks and title
            # (a share of the plot under the axis met the axis title once the legend's rows took the plot's room)
            rows = legend_rows([t["name"] for t in spec.traces if t.get("showlegend", True) and t.get("name")],
                               PRESENTING_PX, PRESENTING_COLUMN_PX * 1.35)
            spec.layout["legend"] = {**legend, "yref": "container", "y": 0, "yanchor": "bottom"}
            spec.layout["margin"] = {**spec.layout.get("margin", {}), "b": UNDER_AXIS_PX + rows * LEGEND_ROW_PX}
        at_least(spec.layout, PRESENTING_PX)
        m = spec.layout.get("margin", {})
        plot = max(100, height - m.get("t", 0) - m.get("b", 0))
        for key, axis in spec.layout.items():  # bigger tick labels and axis titles push the plot in, not out
            if key.startswith(("xaxis", "yaxis")) and isinstance(axis, dict):
                axis["automargin"] = True
            if not (key.startswith("yaxis") and isinstance(axis, dict)) or "tickvals" in axis:
                continue
            low, high = axis.get("domain", [0, 1])  # a short panel: as many labels as lines fit
            lines = max(2, int((high - low) * plot / (1.6 * PRESENTING_PX)))
            if axis.get("type") == "log":  # a tick every few decades
                decades = _decades(spec.traces, "y" + key.removeprefix("yaxis"))
                axis["dtick"] = max(1, -(-decades // lines))
            elif "dtick" not in axis:
                axis["nticks"] = lines
        for t in spec.traces:
            at_least(t, PRESENTING_PX)
            bar = t.get("colorbar")
            if isinstance(bar, dict):  # a colour bar beside a small panel: three ticks and its title's first line
                title = bar.get("title") if isinstance(bar.get("title"), dict) else {}
                first = str(title.get("text", "")).split("<br>")[0]
                t["colorbar"] = {**bar, "nticks": 3, "title": {**title, "text": first}}
            marker = t.get("marker")
            if t.get("type") == "scatter" and isinstance(marker, dict) and "size" in marker:
                t["marker"] = {**marker, "size": round(marker["size"] * 1.6)}
    fit_notes(spec.layout, column * 0.9)
    if name.startswith("cache_map") and "tickvals" in spec.layout.get("yaxis2", {}):
        map_rows.at_height(spec.layout, height)  # its rows apart by pixels, once the title's margin is known
    return spec


def _decades(traces: list, axis: str) -> int:
    """How many powers of ten the positive values drawn on the y axis ``axis`` ("y", "y2", ...) span."""
    values = [v for t in traces if t.get("yaxis", "y") == axis for v in (t.get("y") or [])
              if isinstance(v, (int, float)) and v > 0]
    return math.ceil(math.log10(max(values) / min(values))) + 1 if values else 1


def balance(first: Any, second: Any) -> None:
    """Two cache maps one above the other (side by side, not presenting): heights that give both plots the same
    room within :data:`TWO_MAPS_PX`, whatever their titles and legend take."""
    margins = [s.layout["margin"].get("t", 0) + s.layout["margin"].get("b", 0) for s in (first, second)]
    plot = max(MAP_PLOT_PX, (TWO_MAPS_PX - sum(margins)) // 2)
    for spec, m in zip((first, second), margins):
        map_rows.at_height(spec.layout, plot + m)


def legend_rows(names: list[str], size: float, width: float) -> int:
    """How many rows a horizontal legend of ``names`` takes at font ``size`` in ``width`` pixels (plotly places
    entries one after another, each its text and a 40 px symbol, and starts a row where the next does not fit)."""
    rows, used = 1, 0.0
    for name in names:
        need = len(name) * CHAR * size + 40
        if used and used + need > width:
            rows, used = rows + 1, 0.0
        used += need
    return rows


def set_options(dropdown: Any, options: list, fallback: Any) -> None:
    """New options for a picker, keeping its value when it is still one of them (else ``fallback``)."""
    if list(dropdown.options) != options:
        current = dropdown.value
        dropdown.options = options
        dropdown.value = current if current in options else fallback


def name_model(picker: Any, running: tuple[str, str]) -> None:
    """Give the model picker the named models and the running model, ``(label, value)`` from
    :func:`~.models.picker_entry` (first when it is not a named one), and select the running one."""
    options = [(name, name) for name in MODELS]
    if running not in options:
        options.insert(0, running)
    picker.options = options
    picker.value = running[1]


#: what a full cache means in the explorer, where no cache is made by hand (the error names make_cache's argument)
IN_THE_EXPLORER = {"CacheFullError": "In the explorer: press Reset (or Rewind), or start it with more slots: "
                                     "kvexplore app --max-seq-len N, or Explorer(..., max_seq_len=N) in a notebook."}


def error_html(e: Exception) -> str:
    hint = IN_THE_EXPLORER.get(type(e).__name__, "")
    return (f'<div style="color:#b30000;border:1px solid #e0b4b4;background:#fff6f6;padding:4px 8px;'
            f'border-radius:4px"><b>{type(e).__name__}</b>: {html.escape(str(e))}'
            + (f'<br>{html.escape(hint)}' if hint else "") + '</div>')


def stopped_html(text: str) -> str:
    """A lane stopped while the others go on (a rank of a ``tp:N`` lane died or hung): red, as an error."""
    return (f'<div class="kvx-stopped" style="color:#b30000;border:1px solid #e0b4b4;background:#fff6f6;'
            f'padding:4px 8px;border-radius:4px"><b>RankError</b>: {html.escape(text)}</div>')


def notice_html(text: str) -> str:
    """A notice on the error line: something the person should know that is not an error (amber, not red)."""
    return (f'<div class="kvx-notice" style="color:#7a4a00;border:1px solid #e6c98f;background:#fff8e6;'
            f'padding:4px 8px;border-radius:4px">{html.escape(text)}</div>') if text else ""


@contextmanager
def progress(bar: Any, total: int, text: str):
    """Show ``bar`` (from 0 of ``total``, labelled ``text``) while the block runs; afterwards as it was before (hidden,
    or the outer run's bar: a Run whose first step prefills shows the prefill's progress, then its own again)."""
    before = (bar.max, bar.value, bar.description, bar.layout.display)
    bar.max, bar.value, bar.description = total, 0, text
    bar.layout.display = ""
    try:
        yield bar
    finally:
        bar.max, bar.value, bar.description = before[:3]
        bar.layout.display = before[3] if before[3] == "" else "none"
