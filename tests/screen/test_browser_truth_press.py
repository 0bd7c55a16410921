"""The press lanes (the evict cache, compacting and masking, beside the full cache) in JupyterLab: after every
click the page equals the kernel, and the press figures in the page (their ``gd.data``) hold the cache's own values,
read in the kernel from the cache: scores and kept per KV head, kept masks, held counts and bytes. At more than
2,048 tokens too, binned to the screen and zoomed with the mouse.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from browser_explorer import (LAB, LONG_TOKENS, _checks, _double_click, _drag, _kernel_until, _lab_operations,
                              _notebook, _range, _select, _set, _shot, _tab)
from browser_truth import page_truth

pytestmark = pytest.mark.browser

HERE = Path(__file__).resolve().parent


EVICT_SOURCE = ('import kvexplore\nopts = {"press": "knorm", "compression_ratio": 0.5, "decode_every": 3}\n'
                'ex = kvexplore.Explorer("tiny", strategies=("preallocated", "evict", "evict@mask"), max_seq_len=96, '
                'strategy_options={"evict": opts, "evict@mask": {**opts, "storage": "mask"}})\nex')
PRESS_TABS = (("Press scores", "press"), ("Held per head", "kept"), ("Eviction", "eviction"))


def _cells(trace: dict, key: str) -> dict[tuple[int, int], float]:
    """A heatmap drawn as columns: (row, x) -> its ``key`` value."""
    return {(int(y), int(x)): v for x, y, v in zip(trace["x"], trace["y"], trace[key])}


def _press_page_equals_cache(explorer, state: dict, view: str, label: str,
                             span: tuple[float, float] | None = None) -> None:
    """The press figure in the page (its ``gd.data``) holds the cache's own values (``state["press"]``, read in the
    kernel from the cache, not from a record): scores and kept per KV head, kept masks, held counts, bytes. ``span``:
    the positions on screen (a zoom), drawn one per cell."""
    truth = state["press"]
    on = (lambda p: True) if span is None else (lambda p: span[0] <= p <= span[1])
    fig = page_truth(explorer)["figures"][view]["data"]
    by_name = {t.get("name"): t for t in fig}
    if view == "press":
        heat = by_name["scores"]
        scores, kept = truth["scores"], truth["kept"]
        cells = _cells(heat, "customdata")
        z = _cells(heat, "z")
        want = {(h, p) for h, row in enumerate(kept) for p in range(len(row))
                if scores[h][p] is not None and on(p)}
        assert want <= set(cells), f"after {label}: positions the press scored are missing from the page"
        for (h, p) in want:
            assert math.isclose(cells[(h, p)], scores[h][p], rel_tol=1e-5, abs_tol=1e-6), (label, h, p)
            assert (z[(h, p)] >= 1) == bool(kept[h][p]), (label, h, p)
    elif view == "kept":
        masks = [row for layer in sorted(truth["kept_mask"], key=int) for row in truth["kept_mask"][layer]]
        z = _cells(by_name["kept mask"], "z")
        assert z == {(r, p): float(v) for r, row in enumerate(masks) for p, v in enumerate(row) if on(p)}, label
    else:
        lane = state["lane"]
        for h, n in enumerate(truth["held"][str(truth["layer"])]):
            assert by_name[f"held · head {h} · {lane}"]["y"][-1] == n, (label, h)
        assert by_name[f"reserved · {lane}"]["y"][-1] == truth["reserved_bytes"], label
        assert by_name[f"used · {lane}"]["y"][-1] == truth["used_bytes"], label
        assert by_name["sequence length"]["y"][-1] == truth["length"], label


def _evict_operations(page, explorer, shots: Path, name: str) -> list[str]:
    """Press lanes beside the full cache: after a prefill, steps (presses during decoding), a run, the lane, layer
    and tab picks, a rewind and a step, the page equals the kernel, and the press figures equal the cache's values."""
    done = []
    check, click = _checks(page, explorer, True, done)
    check("display")
    _set(explorer, "prompt", "The whale swam under the ship while the crew slept, and the sea was calm. " * 2)
    click("prefill")
    _select(explorer, "lane", "evict")
    check("strategy evict")
    for title, view in PRESS_TABS:
        state = _tab(explorer, check, title, view, f"tab {title}")
        _press_page_equals_cache(explorer, state, view, f"tab {title} after prefill")
    _set(explorer, "run-n", "5")
    state = click("run", "run 5")
    _press_page_equals_cache(explorer, state, "eviction", "run 5")
    for title, view in PRESS_TABS:
        state = _tab(explorer, check, title, view, f"tab {title} after run")
        _press_page_equals_cache(explorer, state, view, f"tab {title} after run")
        _shot(page, explorer, shots / f"{name}_1280x800_{view}.png")
    _select(explorer, "layer", "2")
    state = check("layer 2")
    _press_page_equals_cache(explorer, state, "eviction", "layer 2")
    for title, view in PRESS_TABS[:1]:
        state = _tab(explorer, check, title, view, f"tab {title} on layer 2")
        _press_page_equals_cache(explorer, state, view, f"tab {title} on layer 2")
    _set(explorer, "rewind-n", "1")
    click("rewind", "rewind 1")
    state = click("step", "step after rewind")
    _press_page_equals_cache(explorer, state, "press", "step after rewind")
    _select(explorer, "lane", "evict@mask")
    state = check("strategy evict@mask")
    _press_page_equals_cache(explorer, state, "press", "strategy evict@mask")
    state = _tab(explorer, check, "Held per head", "kept", "tab Held per head on evict@mask")
    _press_page_equals_cache(explorer, state, "kept", "kept on evict@mask")
    _select(explorer, "lane", "preallocated")
    state = check("strategy preallocated (no press)")
    assert "does not press" in state["specs"]["kept"]["layout"]["annotations"][0]["text"]
    return done


@LAB
def test_lab_press_lanes_page_equals_kernel_and_cache(lab, lab_page, browser, shots):
    """An explorer with the evict cache (compacting and masking) beside the full cache: the press views in the page
    equal the kernel's specs after every click, and hold the cache's own scores, kept masks, counts and bytes."""
    name = "truth_lab_evict"
    _notebook(lab.root / f"{name}.ipynb", EVICT_SOURCE)
    _lab_operations(lab_page, shots, name, _evict_operations, 15)


def _long_press_operations(page, explorer, shots: Path, name: str) -> list[str]:
    """A press lane at more than 2,048 tokens: the press views are binned to the screen; a box zoom with the mouse
    draws one cell per position, and those cells hold the cache's own values, also after a step; a double-click
    shows the whole again."""
    done = []
    check, _ = _checks(page, explorer, True, done, pause_ms=300)
    check("display")
    explorer.locator(".kvx-prefill").first.click()
    _kernel_until(explorer, lambda s: s["tokens"] >= 2048, "the long prefill")
    check(f"prefill of {LONG_TOKENS} tokens")
    _select(explorer, "lane", "evict")
    _kernel_until(explorer, lambda s: s["lane"] == "evict", "the evict lane")
    check("strategy evict")
    for title, view in PRESS_TABS[:2]:
        state = _tab(explorer, check, title, view, f"tab {title}")
        assert "bins of" in state["specs"][view]["layout"]["xaxis"]["title"]["text"], title
        heat = page_truth(explorer)["figures"][view]["data"][0]
        assert len(set(heat["x"])) <= 512, (title, len(set(heat["x"])))
        _shot(page, explorer, shots / f"{name}_{view}_binned.png")
        old = _range(state, view, "xaxis")
        _drag(page, explorer, view, "xy", (0.45, 0.5, 0.5, 0.5))  # a flat box: x only
        _kernel_until(explorer, lambda s, v=view: _range(s, v, "xaxis") != old, f"the zoom on {title}")
        state = check(f"zoom on {title}")
        assert "bins of" not in state["specs"][view]["layout"]["xaxis"]["title"]["text"], title
        span = tuple(sorted(state["specs"][view]["layout"]["xaxis"]["range"]))
        _press_page_equals_cache(explorer, state, view, f"zoom on {title}", span)
        _shot(page, explorer, shots / f"{name}_{view}_zoomed.png")
        n = state["tokens"]
        explorer.locator(".kvx-step").first.click()
        _kernel_until(explorer, lambda s: s["tokens"] == n + 1, "the step")
        state = check(f"step while {title} is zoomed")
        assert tuple(sorted(state["specs"][view]["layout"]["xaxis"]["range"])) == span  # the zoom stays
        _press_page_equals_cache(explorer, state, view, f"step while {title} is zoomed", span)
        _double_click(page, explorer, view, "xy")
        _kernel_until(explorer, lambda s, v=view: "bins of" in s["specs"][v]["layout"]["xaxis"]["title"]["text"],
                      f"the whole {title} after a double-click")
        check(f"double-click: the whole {title}")
    return done


@LAB
def test_lab_long_press_lane_page_equals_kernel_and_cache(lab, lab_page, browser, shots):
    """The evict lane at more than 2,048 tokens on the tiny model: the press views follow the screen (binned, then
    zoomed with the mouse) and the page holds the cache's values."""
    name = "truth_lab_long_evict"
    docs = HERE.parents[1] / "docs"
    _notebook(lab.root / f"{name}.ipynb",
              "from pathlib import Path\nimport kvexplore\n"
              f"text = '\\n'.join(p.read_text() for p in sorted(Path({str(docs)!r}).glob('*.md')))\n"
              "ex = kvexplore.Explorer('tiny', strategies=('preallocated', 'evict'), max_seq_len=2304, "
              "strategy_options={'evict': {'press': 'knorm', 'compression_ratio': 0.5, 'decode_every': 8}})\n"
              f"tok = ex.model.tokenizer\nex.controls['prompt'].value = tok.decode(tok.encode(text)[:{LONG_TOKENS}])\n"
              "ex")
    _lab_operations(lab_page, shots, name, _long_press_operations, 11)
