"""The Stored K/V view (:mod:`kvexplore.views.tensors`) keeps its panels and their labels apart at a chapter's
length as at a sentence's, for the quantized lane (its error per position and per channel), a lane that has
quantized nothing yet and an exact lane (a note in place of the error row), on the shapes of SmolLM2 (3 KV heads of
64 channels), the tiny model (2 of 32) and Gemma 3 (1 of 256).

Without a browser: the geometry the spec decides, at the sizes the explorer draws it (:func:`controls.fit` gives the
height and the type, 12 px or, presenting, 18 px; the widths: 620 px beside the cache map at 1280 x 800, 424 px
there in JupyterLab with its file browser open, 1240 px across the screen): rows that do not overlap and leave room
under each for its axis' tick labels and title, no more tick labels than an axis has room for, the error row, its
note and the colour bars inside the figure. In Chromium (``browser``): the same figures drawn at those sizes and
measured (tests/support/browser_layout.py's rules, and stricter ones: no two text boxes touch, and no text lies on a
plot area or within 2 px of one); screenshots go to ``$KVX_SCREENSHOTS`` (``tensors_*.png``).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kvexplore.caches.slots import SlotView
from kvexplore.explorer import controls
from kvexplore.views import tensors
from kvexplore.views.spec import figure as spec_figure

SHAPES = {"smollm2": (3, 64), "tiny": (2, 32), "gemma3": (1, 256)}  # KV heads, channels a head
LENGTHS = {"short": 20, "long": 2343}  # a question; the first 10,807 characters of GPL-3 in SmolLM2's tokens
LANES = ("quantized", "nothing quantized", "exact")
# figure width, type: beside the cache map at 1280 x 800 (in JupyterLab with its file browser open: narrow), and
# presenting there and on a wider screen
SIZES = {"plain": (620, 12), "plain-narrow": (424, 12), "presenting": (600, controls.PRESENTING_PX),
         "presenting-narrow": (424, controls.PRESENTING_PX), "presenting-wide": (1240, controls.PRESENTING_PX)}
LOOKED_AT = ("plain", "presenting-narrow", "presenting-wide")  # in Chromium (each look costs half a second)
WAITING = ("quantized cache: nothing quantized yet: all {} positions are inside the residual (a block of 32 is "
           "quantized once 128 newer positions follow it, from 160 positions on; a smaller residual or group_size "
           "quantizes sooner)")  # the longest note the row has (KVCache.what_it_did)


def figure(length: str, shape: str, lane: str, size: str):
    """The view as the explorer draws it: a lane of ``length`` positions in a cache grown past them."""
    n, (heads, dim) = LENGTHS[length], SHAPES[shape]
    slots = max(128, n + n // 10)
    g = torch.Generator().manual_seed(n)
    view = SlotView(["filled"] * n + ["free"] * (slots - n), list(range(n)) + [-1] * (slots - n),
                    [1] * n + [0] * (slots - n))
    norms = torch.stack([20 * torch.rand(heads, n, generator=g) + 2, torch.rand(heads, n, generator=g)])
    error = channels = None
    if lane == "quantized":
        error = 0.3 * torch.rand(heads, n, generator=g)
        error[:, -4:] = 0  # the residual: held as written
        channels = (torch.rand(heads, dim, generator=g), 0.05 * torch.rand(heads, dim, generator=g))
    elif lane == "nothing quantized":
        error = torch.zeros(heads, n)
    spec = tensors.spec(None, norms, 0, error, view, did=WAITING.format(n) if error is not None else "",
                        channel_error=channels)
    return controls.fit("tensors", spec, False, size.startswith("presenting"))


CASES = [(length, shape, lane, size) for length in LENGTHS for shape in SHAPES for lane in LANES for size in SIZES]


def line(font: float) -> float:
    """Pixels a line of tick labels or of an axis title takes at ``font`` (its height and plotly's padding)."""
    return 1.2 * font + 2


def panels(layout: dict) -> list[tuple[str, dict, dict]]:
    """(name, x axis, y axis) of every panel drawn (an x axis and the y axis it is anchored to), each with its
    domain (plotly's default: the whole figure)."""
    out = []
    for k, x in layout.items():
        y = layout.get("yaxis" + k[5:]) if k.startswith("xaxis") else None
        if y is not None and x.get("visible", True) and y.get("visible", True):
            out.append((k, {"domain": [0, 1], **x}, {"domain": [0, 1], **y}))
    return out


def below(axis: dict, font: float) -> float:
    """Pixels an x axis takes under its panel: its tick labels (if shown) and its title's lines."""
    title = (axis.get("title") or {}).get("text", "")
    return line(font) * (labelled(axis) + (title.count("<br>") + 1 if title else 0))


def labelled(axis: dict) -> bool:
    """Whether the axis draws its tick labels."""
    return axis.get("showticklabels", True) is not False


def problems(spec, width: float, font: float, positions: int) -> list[str]:
    """What does not fit in ``spec`` (of ``positions`` positions) drawn ``width`` px wide with type of ``font`` px."""
    layout, out = spec.layout, []
    m = layout["margin"]
    lowest = max((below(x, font) for _, x, y in panels(layout) if y["domain"][0] == 0), default=0)
    bottom = max(m["b"], lowest + 4)  # presenting, plotly's automargin grows the bottom margin to the labels
    if bottom > m["b"] and not all(a.get("automargin") for k, a in layout.items() if k.startswith("xaxis")):
        out.append(f"the bottom row's labels need {lowest:.0f} px, the margin is {m['b']}")
    tall = layout["height"] - m["t"] - bottom  # the plot area, in pixels
    wide = width - m["l"] - m["r"] - 75  # less the colour bars (their ticks and titles) beside the plot
    shown = panels(layout)
    for i, (name, x, y) in enumerate(shown):
        out += panel_problems(name, x, y, tall, wide, font, positions)
        out += [f"{name} and {other}: {p}" for other, ox, oy in shown[i + 1:]
                for p in pair_problems((x, y), (ox, oy), tall, wide, font)]
    rows = [y["domain"] for _, _, y in shown]
    for bar in (t["colorbar"] for t in spec.traces if "colorbar" in t and t.get("visible", True)):
        lo, hi = bar["y"] - bar["len"] / 2, bar["y"] + bar["len"] / 2
        if not any(r[0] <= lo and hi <= r[1] for r in rows):
            out.append(f"colour bar {bar['title']['text']} at {lo:.2f}..{hi:.2f} beside no row")
        if bar["title"].get("side") != "right":
            out.append(f"colour bar {bar['title']['text']}: its title above the bar meets its top label")
    for note in layout.get("annotations") or []:  # the error row's note: from its top into the margin below it
        error = layout["yaxis3"]
        lines = note["text"].count("<br>") + 1
        room = error["domain"][1] * tall + bottom - 4
        if error.get("visible", True) or note["y"] != error["domain"][1] or note["yanchor"] != "top":
            out.append("the note is not alone in the error row, from its top down")
        if lines * 1.3 * max(font, note["font"]["size"]) > room:
            out.append(f"the note's {lines} lines take more than the {room:.0f} px under the values")
    return out


def panel_problems(name: str, x: dict, y: dict, tall: float, wide: float, font: float, positions: int) -> list[str]:
    """A panel inside the figure, its head labels within its height and its tick labels within its width."""
    out = []
    (x0, x1), (y0, y1) = x["domain"], y["domain"]
    if not (0 <= x0 < x1 <= 1 and 0 <= y0 < y1 <= 1):
        out.append(f"{name}: domains {x['domain']} x {y['domain']} outside the figure")
    heads = math.ceil((y["range"][1] - y["range"][0]) / y.get("dtick", 1))
    if labelled(y) and heads * line(font) > (y1 - y0) * tall + 1:
        out.append(f"{name}: {heads} head labels in {(y1 - y0) * tall:.0f} px")
    digits = max(len(str(round(v))) for v in x.get("range") or [positions])
    chars = 1 + (x.get("nticks", 99) - 1) * (digits + 1)  # "0", then labels of up to ``digits`` a digit apart
    if labelled(x) and ("nticks" not in x or chars * 0.6 * font > (x1 - x0) * wide):
        out.append(f"{name}: up to {x.get('nticks')} labels of {digits} digits in {(x1 - x0) * wide:.0f} px")
    return out


def pair_problems(a: tuple[dict, dict], b: tuple[dict, dict], tall: float, wide: float, font: float) -> list[str]:
    """Two panels (x axis, y axis): one above the other with the upper one's x labels between them, or side by side
    with the right one's head labels between them."""
    (ax, ay), (bx, by) = a, b
    (a0, a1), (b0, b1) = ax["domain"], bx["domain"]
    (c0, c1), (d0, d1) = ay["domain"], by["domain"]
    if min(a1, b1) > max(a0, b0):  # they share some of the width: one above the other
        upper, gap = (ax, c0 - d1) if c0 >= d1 else (bx, d0 - c1)
        need = below(upper, font)
        return [f"{gap * tall:.0f} px between them, {need:.0f} needed for the labels"] if gap * tall < need else []
    if min(c1, d1) > max(c0, d0):  # side by side
        right, gap = (by, b0 - a1) if b0 >= a1 else (ay, a0 - b1)
        need = 0.6 * font * 2 + 6 if labelled(right) else 4
        return [f"{gap * wide:.0f} px apart, {need:.0f} needed"] if gap * wide < need else []
    return []


@pytest.mark.parametrize("length,shape,lane,size", CASES)
def test_the_panels_leave_room_for_their_labels(length, shape, lane, size):
    spec = figure(length, shape, lane, size)
    layout = spec.layout
    assert layout["xaxis"]["showticklabels"] is False  # the slot axis is labelled under the values only
    assert layout["xaxis3"]["title"]["text"].startswith("position") and layout["yaxis3"]["domain"][0] == 0
    assert ("xaxis4" in layout) == (lane == "quantized")
    width, font = SIZES[size]
    assert problems(spec, width, font, LENGTHS[length]) == []


def test_a_zoomed_slot_axis_wraps_its_title_and_the_rows_make_room():
    """Zoomed into a long cache, the slot axis' title says which slots and the bins' size: a line more at the
    narrowest width, and the values' row moves up to keep it clear of the error row."""
    n = 2343
    view = SlotView(["filled"] * n, list(range(n)), [1] * n)
    norms = torch.rand(2, 3, n)
    one = tensors.spec(None, norms, 0, None, view)
    zoomed = tensors.spec(None, norms, 0, None, view, zoom={"xaxis": (1000.0, 2000.0)}, max_bins=256)
    lines = [spec.layout["xaxis2"]["title"]["text"].count("<br>") + 1 for spec in (one, zoomed)]
    assert lines[0] <= 2 and lines[1] == lines[0] + 1
    assert zoomed.layout["yaxis2"]["domain"][0] > one.layout["yaxis2"]["domain"][0]
    for spec in (one, zoomed):
        for size, (width, font) in SIZES.items():
            fitted = controls.fit("tensors", copy.deepcopy(spec), False, size.startswith("presenting"))
            assert problems(fitted, width, font, n) == []


def test_many_kv_heads_are_labelled_every_few():
    """Eight KV heads (Llama 3 8B's) do not fit eight labels in a row at 18 px: every few is labelled (three or
    more labels a row still)."""
    n = 64
    view = SlotView(["filled"] * n, list(range(n)), [1] * n)
    spec = tensors.spec(None, torch.rand(2, 8, n), 0, torch.rand(8, n), view,
                        channel_error=(torch.rand(8, 128), torch.rand(8, 128)))
    for axis in ("yaxis", "yaxis2", "yaxis3", "yaxis4"):
        assert spec.layout[axis]["dtick"] > 1 and math.ceil(8 / spec.layout[axis]["dtick"]) >= 3
    for size, (width, font) in SIZES.items():
        fitted = controls.fit("tensors", copy.deepcopy(spec), False, size.startswith("presenting"))
        assert problems(fitted, width, font, n) == []


def test_the_figures_are_valid_plotly():
    """Every property the view sets is one plotly knows (plotly checks them building a figure)."""
    for lane in LANES:
        spec_figure(figure("long", "smollm2", lane, "presenting"))


def test_the_explorer_draws_each_lane_within_the_rules(trained):
    """Through the explorer (its fitting, the caches' own errors and notes): an exact lane, KIVI at 4 and at 2 bits
    once something is quantized, and llama.cpp's types, plain and presenting."""
    import kvexplore

    options = {"quantized": {"group_size": 8, "residual": 4},
               "quantized@2": {"key_bits": 2, "value_bits": 2, "group_size": 8, "residual": 4},
               "quantized@ggml": {"k_type": "q4_0", "v_type": "q8_0"}}
    ex = kvexplore.Explorer(trained, strategies=("preallocated", *options), max_seq_len=64, strategy_options=options,
                            prompt="The whale swam under the ship while the crew slept, and the sea was calm.")
    ex.run(2)
    n = ex.lane.cache.length
    for lane in ("preallocated", *options):
        ex.controls["lane"].value = lane
        for size, (width, font) in SIZES.items():
            ex.presentation = size.startswith("presenting")
            spec = ex.specs(["tensors"])["tensors"]
            assert ("xaxis4" in spec.layout) == (lane in ("quantized", "quantized@2")), lane
            assert problems(spec, width, font, n) == [], (lane, size)
            # what the error row's note says: exact only of an exact lane; llama.cpp's types keep no originals
            notes = " ".join(a["text"].replace("<br>", " ") for a in spec.layout.get("annotations", []))
            assert ("exact cache" in notes) == (lane == "preallocated"), (lane, notes)
            assert ("the originals are not kept" in notes) == (lane == "quantized@ggml"), (lane, notes)


# --- in Chromium ---------------------------------------------------------------------------------------------------

# every text box of the figure (tick labels, titles, colour bar labels, notes) against every other and against
# every plot area: nothing may touch
STRICT = r"""(gd) => {
  const out = [], fr = gd.getBoundingClientRect();
  const texts = [...gd.querySelectorAll('svg text')]
    .filter(t => (t.textContent || '').trim() && !t.closest('.hoverlayer'))
    .map(e => ({e, r: e.getBoundingClientRect()}));
  const say = t => `"${t.e.textContent.trim().slice(0, 30)}"`;
  for (const t of texts)
    if (t.r.left < fr.left - 1 || t.r.right > fr.right + 1 || t.r.top < fr.top - 1 || t.r.bottom > fr.bottom + 1)
      out.push(`outside the figure: ${say(t)}`);
  const meet = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 0.5 &&
                         Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 0.5;
  for (let i = 0; i < texts.length; i++)
    for (let j = i + 1; j < texts.length; j++)
      if (!texts[i].e.contains(texts[j].e) && !texts[j].e.contains(texts[i].e) && meet(texts[i].r, texts[j].r))
        out.push(`touch: ${say(texts[i])} and ${say(texts[j])}`);
  const axis = a => gd._fullLayout[a.replace(/^x/, 'xaxis').replace(/^y/, 'yaxis')] || {};
  const plots = [...gd.querySelectorAll('.nsewdrag')]  // the panels drawn (a hidden row keeps its drag area)
    .filter(d => (d.dataset.subplot || '').match(/^(x\d*)(y\d*)$/).slice(1).every(a => axis(a).visible !== false))
    .map(d => d.getBoundingClientRect());
  for (const t of texts)
    if (plots.some(p => meet(t.r, {left: p.left - 2, right: p.right + 2, top: p.top - 2, bottom: p.bottom + 2})))
      out.push(`on a plot or within 2 px of it: ${say(t)}`);
  return out;
}"""
BROWSER_CASES = [(length, "smollm2", lane, size) for length in LENGTHS for lane in LANES for size in LOOKED_AT]


@pytest.mark.browser
def test_in_chromium_no_label_touches_another_or_a_panel(browser, shots):
    from browser_layout import CHECK
    from browser_support import new_page, screenshot
    from plotly.offline import get_plotlyjs

    from kvexplore.explorer.inspect import plain

    page = new_page(browser)
    try:
        page.set_viewport_size({"width": 1300, "height": 700})
        page.set_content("<html><body style='margin:0'><div class='kvx-explorer'><div id='fig'></div></div>"
                         "</body></html>")
        page.add_script_tag(content=get_plotlyjs())
        found = {}
        for case in BROWSER_CASES:
            spec = figure(*case)
            width, font = SIZES[case[-1]]
            page.evaluate("async ([data, layout]) => { const gd = document.getElementById('fig'); Plotly.purge(gd);"
                          " gd.style.width = layout.width + 'px'; gd.style.height = layout.height + 'px';"
                          " await Plotly.newPlot(gd, data, layout);"  # then two frames: margins grown to the labels
                          " await new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r))); }",
                          [plain(spec.traces), dict(plain(spec.layout), width=width)])
            name = "_".join(case).replace(" ", "-")
            screenshot(page.locator("#fig"), shots / f"tensors_{name}.png")
            seen = page.locator(".kvx-explorer").evaluate(CHECK, {"minFont": font if font > 12 else None,
                                                                  "plotShare": 0.25})
            seen += page.locator("#fig").evaluate(STRICT)
            if seen:
                found[name] = seen
        assert not found, "\n".join(f"{k}: {v}" for k, v in found.items())
    finally:
        page.close()
