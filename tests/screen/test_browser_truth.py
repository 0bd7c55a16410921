"""The page shows exactly what the kernel holds after every kind of operation, in JupyterLab and in Voila.

After each operation (prefill, step, run N, rewind, fork, a strategy switch, layer and head picks, every tab, side
by side, presentation, a sampling change, reset, a model load) the kernel is asked what its explorer holds
(``kvexplore.explorer.inspect``) and every figure on screen is read from the page (each plotly div's ``gd.data`` and
layout, and the compare table's text); they must agree (:func:`browser_truth.mismatches` names the figure, trace and
property that do not). The page may not ask for anything outside 127.0.0.1. Screenshots of every view at 1280x800,
1920x1080 and 1024x768 go to ``$KVX_SCREENSHOTS``; at 1280x800 the controls, token strip, cache map and attention
must be on screen together. A prompt typed or pasted into the box is the prompt the kernel prefills.

More than 2,048 tokens, with zooms from the mouse: ``test_browser_truth_long.py``; the press lanes, whose figures
must also hold the cache's own values: ``test_browser_truth_press.py``. The driving is ``browser_explorer.py``'s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from browser_explorer import (LAB, VIEWPORT, _agree, _checks, _frames, _idle, _kernel_until, _notebook, _select,
                              _sequence, _set, _shot, _smollm2)
from browser_explorer import SETTLE_S, _lab_operations, _tab  # noqa: F401 (test_browser_prefix/_speculative's)
from browser_support import (figure, new_page, open_voila_app, require_browser, save_timings, screenshot, start_run_all,
                             voila_server, wait_run_finished)
from browser_truth import kernel_truth, page_figures

pytestmark = pytest.mark.browser

SUPPORT = Path(__file__).resolve().parents[1] / "support"  # the helpers a kernel imports


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
    _sequence(explorer, click, "The whale swam")
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
                    'import kvexplore\nex = kvexplore.Explorer("tiny", strategies=("preallocated", "paged", '
                    '"quantized", "bug:length-counted-early"), max_seq_len=64, '
                    'strategy_options={"paged": {"block_size": 8}})\nex')
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
    cells = [f"import sys\nsys.path.insert(0, {str(SUPPORT)!r})\nfrom pathlib import Path\n"
             f"import kvexplore, transformers\nfrom helpers import make_checkpoint"]
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


@LAB
@pytest.mark.smollm2
def test_lab_smollm2_two_strategies_page_equals_kernel(lab, lab_page, browser, shots):
    _smollm2()
    _run_lab(lab, lab_page, shots, "truth_lab_smollm2",
             'import kvexplore\nex = kvexplore.Explorer("smollm2-135m", strategies=("preallocated", "concat"), '
             'max_seq_len=96)\nex', every=False)  # the page-wide operations: on tiny in Voila (below)


def test_voila_app_page_equals_kernel(tmp_path, browser, shots):
    """``kvexplore app`` in Voila (the tiny model and the app's own lanes, as `kvexplore app` starts) shows the
    explorer and no code, and the page equals the kernel after every kind of operation and after a pasted chapter
    (refused, then 900 tokens and a typed sentence). SmolLM2's app, a whole chapter pasted: test_browser_layout.py's
    ``test_the_smollm2_app_with_a_pasted_chapter_equals_the_kernel_shows_progress_and_fits``."""
    from playwright.sync_api import expect

    require_browser("voila", "ipywidgets", "plotly", "anywidget")
    name = "truth_voila_tiny"
    timings = {}
    with voila_server(tmp_path, model="tiny") as server:
        page = new_page(browser)
        try:
            page.set_viewport_size(VIEWPORT)
            t0 = time.monotonic()
            open_voila_app(page, server, timeout_s=150)
            _shows_no_code(page)
            done = _session(page, False, shots, name, timings, t0)  # every kind of operation
            expect(page.locator(".kvx-static:visible")).to_have_count(0)  # the static copy is for kernel-less pages
            explorer = page.locator(".kvx-explorer").first
            done += _pasted_chapter(page, explorer, shots, name)
            done += _linked_view(page, server, explorer, shots, name)
        finally:
            page.close()
    save_timings(shots, name, timings)
    assert len(done) >= 20, done
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


def _linked_view(page, server, explorer, shots: Path, name: str) -> list[str]:
    """The page's "link to this view" button writes the address of what it shows; opening it (a new page load, a
    fresh kernel: the model, the lanes, the 900-token prompt prefilled, the step run, the lane, layer, head and tab)
    shows the same figures, and the page equals its kernel."""
    from urllib.parse import urljoin

    views = kernel_truth(explorer)["shown"]
    shown = {view: fig["data"] for view, fig in page_figures(explorer).items() if view in views}
    explorer.locator(".kvx-app-link-button").first.click()
    anchor = page.locator(".kvx-app-link a").first
    anchor.wait_for(timeout=60_000)
    href = anchor.get_attribute("href")
    assert "steps=1" in href and "prompt=" in href and "lane=" in href, href
    page.goto(urljoin(server.base_url + "/", href))
    linked = page.locator(".kvx-explorer").first
    linked.wait_for(timeout=150_000)
    _idle(page, linked)
    state = _agree(page, linked, False, "the linked view")
    assert state["error"] == "" and state["shown"] == views, (state["error"], state["shown"], views)
    again = {view: fig["data"] for view, fig in page_figures(linked).items() if view in views}
    assert again.keys() == shown.keys() and again == shown, "the linked view's figures differ from the view's"
    screenshot(page, shots / f"{name}_linked_view.png")
    return ["a link to the view opens the same view"]


def _shows_no_code(page) -> None:
    """The Voila page shows neither the app notebook's code nor an error stream."""
    from playwright.sync_api import expect

    expect(page.locator("body")).not_to_contain_text("KVEXPLORE_APP_MODEL")  # the code cell's text
    code = page.locator(".jp-CodeCell .jp-InputArea, .jp-CodeMirrorEditor, .jp-CodeCell .jp-InputPrompt")
    shown = [c.evaluate("e => e.className + ': ' + e.textContent.slice(0, 80)") for c in code.all() if c.is_visible()]
    assert not shown, f"Voila shows code: {shown}"
    expect(page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")).to_have_count(0)


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
