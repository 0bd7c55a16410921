"""The page shows exactly what the kernel holds at more than 2,048 tokens: the cache map and the attention are
binned to the screen, a box zoom dragged with the mouse draws every position of the span (and stays through a step),
a double-click shows the whole again, and after every click, zoom, rewind and pick the page equals the kernel
(:func:`browser_truth.mismatches`). The press views at that length: ``test_browser_truth_press.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from browser_explorer import (LAB, LONG_TOKENS, _checks, _double_click, _drag, _kernel_until, _lab_operations,
                              _notebook, _range, _select, _set, _shot)

pytestmark = pytest.mark.browser

HERE = Path(__file__).resolve().parent


def _long_operations(page, explorer, shots: Path, name: str) -> list[str]:
    """Prefill more than 2,048 tokens, step, zoom the cache map and the attention history with the mouse, step
    while zoomed, clear the zooms with a double-click, rewind, switch lane, layer and view: after each, the page
    equals the kernel. Clicks follow each other after a short pause."""
    done = []
    check, _ = _checks(page, explorer, True, done, pause_ms=300)

    def after(button, label, done):  # a click, then the kernel's state once the click reached it
        explorer.locator(f".kvx-{button}").first.click()
        _kernel_until(explorer, done, label)
        return check(label)

    state = check("display")
    state = after("prefill", f"prefill of {LONG_TOKENS} tokens", lambda s: s["tokens"] >= 2048)
    assert "bins of" in state["specs"]["cache_map"]["layout"]["xaxis"]["title"]["text"]
    n = state["tokens"]
    state = after("step", "step", lambda s: s["tokens"] == n + 1)
    _shot(page, explorer, shots / f"{name}_binned.png")
    old = _range(state, "cache_map", "xaxis")
    _drag(page, explorer, "cache_map", "xy", (0.45, 0.5, 0.5, 0.5))  # a flat box: x only
    _kernel_until(explorer, lambda s: _range(s, "cache_map", "xaxis") != old, "the zoom on the cache map")
    state = check("zoom on the cache map")
    lo, hi = sorted(state["specs"]["cache_map"]["layout"]["xaxis"]["range"])
    assert 0 < hi - lo <= 512, (lo, hi)
    assert "bins of" not in state["specs"]["cache_map"]["layout"]["xaxis"]["title"]["text"]  # full resolution
    tokens = state["specs"]["cache_map"]["traces"][1]
    assert tokens["x"] and all(float(x).is_integer() for x in tokens["x"])
    _shot(page, explorer, shots / f"{name}_zoomed.png")
    n = state["tokens"]
    state = after("step", "step while zoomed", lambda s: s["tokens"] == n + 1)
    assert sorted(state["specs"]["cache_map"]["layout"]["xaxis"]["range"]) == [lo, hi]  # the zoom stays
    old = _range(state, "attention", "xaxis2")
    _drag(page, explorer, "attention", "x2y2", (0.6, 0.55, 0.9, 0.85))  # a box on the history: x and y
    _kernel_until(explorer, lambda s: _range(s, "attention", "xaxis2") != old, "the zoom on the history")
    state = check("zoom on the attention history")
    assert "range" in state["specs"]["attention"]["layout"]["yaxis2"]
    _double_click(page, explorer, "cache_map", "xy")
    _kernel_until(explorer, lambda s: "bins of" in s["specs"]["cache_map"]["layout"]["xaxis"]["title"]["text"],
                  "the whole cache map after a double-click")
    check("double-click: the whole cache map")
    old = _range(state, "attention", "yaxis2")
    _double_click(page, explorer, "attention", "x2y2")
    _kernel_until(explorer, lambda s: _range(s, "attention", "yaxis2") != old, "the whole attention history")
    state = check("double-click: the whole attention history")
    _set(explorer, "rewind-n", "3")
    n = state["tokens"]
    state = after("rewind", "rewind 3", lambda s: s["tokens"] == n - 3)
    state = after("step", "step after rewind", lambda s: s["tokens"] == n - 2)
    _select(explorer, "lane", "paged")
    _kernel_until(explorer, lambda s: s["lane"] == "paged", "the paged lane")
    check("strategy paged")
    _select(explorer, "layer", "1")
    _kernel_until(explorer, lambda s: "layer 1" in s["specs"]["attention"]["layout"]["title"]["text"], "layer 1")
    check("layer 1")
    for title, view in (("Stored K/V", "tensors"), ("Memory", "memory"), ("Attention", "attention")):
        explorer.locator(f".kvx-view button:text-is('{title}')").first.click()
        _kernel_until(explorer, lambda s, v=view: s["view"] == v, f"the {title} tab")
        check(f"tab {title}")
    after("step", "step on paged, layer 1", lambda s: s["tokens"] == n - 1)
    _shot(page, explorer, shots / f"{name}_end.png")
    return done


@LAB
def test_lab_long_context_page_equals_kernel(lab, lab_page, browser, shots):
    """The explorer at more than 2,048 tokens (the tiny model, pre-allocated and paged caches): what a figure draws
    is binned to the screen, zooms come from the mouse, and after every operation the page equals the kernel."""
    name = "truth_lab_long"
    docs = HERE.parents[1] / "docs"
    _notebook(lab.root / f"{name}.ipynb",
              "from pathlib import Path\nimport kvexplore\n"
              f"text = '\\n'.join(p.read_text() for p in sorted(Path({str(docs)!r}).glob('*.md')))\n"
              "ex = kvexplore.Explorer('tiny', strategies=('preallocated', 'paged'), max_seq_len=2304, "
              "strategy_options={'paged': {'block_size': 16}})\n"
              f"tok = ex.model.tokenizer\nex.controls['prompt'].value = tok.decode(tok.encode(text)[:{LONG_TOKENS}])\n"
              "ex")
    _lab_operations(lab_page, shots, name, _long_operations, 16)
