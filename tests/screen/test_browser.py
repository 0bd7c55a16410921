"""The explorer in a real browser: JupyterLab and the Voila app in headless Chromium, driven by Playwright.

* ``01_tour.ipynb`` runs top to bottom in JupyterLab, the explorer and its plotly figures render, and pressing Step
  adds one token to the strip, redraws the cache map and advances the status line.
* every notebook in ``notebooks/`` opens and renders in JupyterLab without an error dialog.
* (``kvexplore app``, Voila, is checked in ``test_browser_truth.py``: no code shown, and every operation.)

Screenshots (full page, plus the explorer alone) go to ``$KVX_SCREENSHOTS`` (default: a pytest temporary folder),
with ``timings.json``. Look at them: a test that passes while the page looks broken is not done.
Run: ``KVX_SCREENSHOTS=/tmp/shots python -m pytest -q tests/screen/test_browser.py -s``.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from browser_support import (LAB_SCROLLER, NOTEBOOKS, PLOT_SIGNATURE, WIDGETS_S, figure, plot_signature, rendered_cells,
                             save_timings, start_run_all, tall_screenshot, token_count, undrawn_traces,
                             wait_run_finished)

pytestmark = pytest.mark.browser
# the course's notebooks share one JupyterLab server and page, in a group of their own: the page-truth and layout
# tests (group "lab") then run beside them on another worker, with their own server (each worker starts one)
LAB = pytest.mark.xdist_group("lab-course")

ALL = sorted(NOTEBOOKS.glob("*.ipynb"))
TOUR = "01_tour.ipynb"
FIGURES = ("cache_map", "attention")  # on screen: the cache map and the tab's view (attention first)


def _wait_figures(explorer) -> None:
    for name in FIGURES:
        figure(explorer, name).wait_for(state="visible", timeout=WIDGETS_S * 1000)


def _wait_plot_changed(page, plot, before: str) -> None:
    page.wait_for_function(f"([el, before]) => ({PLOT_SIGNATURE})(el) !== before",
                           arg=[plot.element_handle(), before], polling=100)


def _step_and_check(page, explorer, steps: int = 2) -> float:
    """Press Step ``steps`` times; each press adds exactly one token and redraws the cache map. Seconds per step."""
    from playwright.sync_api import expect

    plot = figure(explorer, "cache_map")
    tokens = explorer.locator(".kvx-tokens .kvx-tok")
    status = explorer.locator(".kvx-status").first
    expect(tokens.last).to_be_visible()
    n = token_count(explorer)
    assert n > 0, "the token strip is empty before the first step"
    first = re.search(r"\bstep (\d+)\b", status.inner_text())
    t0 = time.monotonic()
    for i in range(1, steps + 1):
        before = plot_signature(plot)
        explorer.locator(".kvx-step").first.click()
        expect(tokens).to_have_count(n + i)
        _wait_plot_changed(page, plot, before)
        expect(status).to_contain_text(re.compile(rf"\bstep {int(first[1]) + i}\b") if first else "step")
    elapsed = (time.monotonic() - t0) / steps
    for name in FIGURES:  # what the browser holds is drawable: no trace with data that plotly.js refused
        assert undrawn_traces(figure(explorer, name)) == [], (
            f"{name}: traces with data that plotly.js does not draw (arrays missing or inconsistent in the browser)")
    errors = explorer.locator(".kvx-error")
    if errors.count():
        assert errors.first.inner_text().strip() == "", f"the explorer shows an error: {errors.first.inner_text()}"
    return elapsed


@LAB
@pytest.mark.smollm2
def test_tour_runs_and_step_updates_the_explorer(lab, lab_page, browser, shots):
    from playwright.sync_api import expect

    if not (lab.root / TOUR).exists():
        pytest.skip(f"{NOTEBOOKS / TOUR} does not exist yet")
    timings = {"lab_ready": lab.ready_s}
    t0 = time.monotonic()
    with lab_page.notebook(TOUR) as page:
        try:
            timings["open_to_kernel_idle"] = time.monotonic() - t0
            t0 = time.monotonic()
            start_run_all(page)
            explorer = page.locator(".kvx-explorer").first
            explorer.wait_for(timeout=WIDGETS_S * 1000)
            _wait_figures(explorer)
            timings["run_all_to_widgets"] = time.monotonic() - t0
            errors = wait_run_finished(page)
            timings["run_all_to_finished"] = time.monotonic() - t0
            tall_screenshot(page, shots / "lab_tour_after_run_all.png", LAB_SCROLLER)
            assert not errors, f"{TOUR} raised: {errors}"

            timings["click_to_update"] = _step_and_check(page, explorer)
            expect(page.locator(".kvx-static:visible")).to_have_count(0)  # the static copy is for kernel-less pages
            tall_screenshot(page, shots / "lab_tour_after_step.png", LAB_SCROLLER)
            tall_screenshot(page, shots / "lab_tour_explorer.png", LAB_SCROLLER, element=explorer,
                            parts={shots / f"lab_tour_fig_{name}.png": figure(explorer, name) for name in FIGURES})
            expect(page.locator(".jp-Dialog")).to_have_count(0)
        except Exception:
            tall_screenshot(page, shots / "lab_tour_FAILED.png", LAB_SCROLLER)
            raise
        finally:
            save_timings(shots, "lab_tour", timings)


def _marks(path: Path) -> list:
    return [LAB, pytest.mark.notebooks, *([pytest.mark.smollm2] if "smollm2" in path.read_text() else [])]


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=_marks(p)) for p in ALL])
def test_notebook_opens_and_renders(path, lab, lab_page, browser, shots, executed_notebook):
    """The executed copy (shared with test_notebooks.py) opens in JupyterLab: every cell, the markdown rendered, the
    code, the outputs it holds, and no error dialog."""
    import shutil

    from playwright.sync_api import expect

    copy, _ = executed_notebook(path)
    nb = json.loads(copy.read_text())
    kinds = [c["cell_type"] for c in nb["cells"]]
    outputs = sum(len(c.get("outputs", [])) for c in nb["cells"] if c["cell_type"] == "code")
    (lab.root / "executed").mkdir(exist_ok=True)
    shutil.copy(copy, lab.root / "executed" / path.name)
    with lab_page.notebook(f"executed/{path.name}") as page:
        drawn = rendered_cells(page)
        assert drawn["cells"] == len(kinds), drawn
        assert drawn["markdown"] == kinds.count("markdown") and drawn["code"] == kinds.count("code"), drawn
        assert (drawn["outputs"] > 0) == (outputs > 0), drawn
        expect(page.locator(".jp-Dialog")).to_have_count(0)
        tall_screenshot(page, shots / f"lab_open_{path.stem}.png", LAB_SCROLLER)
