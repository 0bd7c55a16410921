"""Browser truth for the prefix cache's views, over a real PrefixPool on the tiny model.

In the run's JupyterLab: a notebook cell serves four requests and shows ``kvexplore.PrefixView(pool)``; after the
first draw, after each slider move (a pause between moves, as a teacher's) and after the pool serves one more
request from the kernel (the widget follows: its slider grows and moves), every figure's ``gd.data`` in the page
equals the kernel's spec (``kvx-truth``, ``KVEXPLORE_INSPECT``). The HTML replay of a pool, opened from disk in
Chromium with the network blocked: after each slider move, every figure equals that frame's spec. Screenshots go to
``$KVX_SCREENSHOTS``.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest

import kvexplore
from browser_support import screenshot
from browser_truth import kernel_truth, mismatches, page_figures
from kvexplore.explorer.inspect import plain
from kvexplore.views.prefix import BUILT_IN as NAMES, figures
from test_browser_truth import LAB, SETTLE_S, _agree, _frames, _notebook

pytestmark = pytest.mark.browser

SYSTEM = "You are a terse guide at the whale museum. Answer in one short sentence. "
QUESTIONS = ("Where is the whale skeleton?", "When does the museum open?", "Where is the whale skeleton?",
             "Tell me about the ships in the harbour and the sea.")
SOURCE = (f"import kvexplore\npool = kvexplore.PrefixPool(kvexplore.load('tiny'), num_blocks=24, block_size=8, "
          f"policy='hash')\nfor q in {QUESTIONS!r}:\n    pool.serve({SYSTEM!r} + q, max_new_tokens=4)\n"
          f"view = kvexplore.PrefixView(pool)\nview")
PAUSE_MS = 600  # between slider moves, as a person pauses to look


def _kernel_at(page, root, frame: int, frames: int | None = None) -> None:
    t0 = time.monotonic()
    while True:
        state = kernel_truth(root)
        if state["frame"] == frame and (frames is None or state["frames"] == frames):
            return
        assert time.monotonic() - t0 < SETTLE_S, f"the kernel never showed frame {frame}: {state['frame']}"
        page.wait_for_timeout(100)


def _slide(page, root, key: str) -> None:
    """Move the slider one frame with the keyboard, as a person does (focus the handle, press an arrow)."""
    handle = root.locator(".kvx-prefix-slider .noUi-handle").first
    handle.focus()
    handle.press(key)


def _shot(page, root, path) -> None:
    root.evaluate("(e) => e.scrollIntoView({block: 'start'})")
    _frames(page)
    screenshot(page, path)


@contextmanager
def _run(lab, lab_page, name: str, source: str, width: int):
    """A one-cell notebook of ``source`` open in JupyterLab and run to the end: its page."""
    from browser_support import start_run_all, wait_run_finished

    _notebook(lab.root / f"{name}.ipynb", source)
    with lab_page.notebook(f"{name}.ipynb", {"width": width, "height": 1000}) as page:
        start_run_all(page)
        assert not wait_run_finished(page)
        yield page


def _drawn(root) -> None:
    root.wait_for(timeout=120_000)
    for fig in NAMES:
        root.locator(f".kvx-fig-{fig} .js-plotly-plot").first.wait_for(timeout=120_000)


@LAB
def test_lab_prefix_view_page_equals_kernel(lab, lab_page, browser, shots):
    name = "truth_lab_prefix"
    with _run(lab, lab_page, name, SOURCE, 1280) as page:
        root = page.locator(".kvx-prefix-view").first
        try:
            _drawn(root)
            state = _agree(page, root, True, "display")
            assert (state["frame"], state["frames"]) == (4, 5)
            _shot(page, root, shots / f"{name}_1280x1000_last.png")
            done = ["display"]
            for frame in (3, 2, 1, 0):
                _slide(page, root, "ArrowLeft")
                _kernel_at(page, root, frame)
                _agree(page, root, True, f"slider to frame {frame}")
                done.append(f"slider to {frame}")
                if frame == 2:
                    _shot(page, root, shots / f"{name}_1280x1000_frame2.png")
                page.wait_for_timeout(PAUSE_MS)
            _slide(page, root, "ArrowRight")
            _kernel_at(page, root, 1)
            _agree(page, root, True, "slider forward to frame 1")
            # the pool serves a request while the widget is shown: the slider grows and moves to it
            page.evaluate("""() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel
                .requestExecute({code: "pool.serve('You are a terse guide at the whale museum. Where is the gift "
                                 + "shop?', max_new_tokens=4)"}).done.then(() => true)""")
            _kernel_at(page, root, 5, 6)
            _agree(page, root, True, "a request served live")
            assert root.locator(".kvx-prefix-slider .widget-readout").first.inner_text().strip() == "5"
            assert "request 4" in root.locator(".kvx-prefix-story-box").first.inner_text()
            _shot(page, root, shots / f"{name}_1280x1000_live.png")
            done.append("live request")
            for _ in range(2):
                _slide(page, root, "ArrowLeft")
            _kernel_at(page, root, 3)
            root.locator(".kvx-prefix-play button").first.click()  # play: frames 4, 5, then it stops
            _kernel_at(page, root, 5)
            _agree(page, root, True, "played to the end")
            done.append("play")
        except Exception:
            screenshot(page, shots / f"{name}_FAILED.png")
            raise
    assert len(done) == 7, done


READY = "(r) => r.dataset.kvxReady === '1' || !!r.dataset.kvxError"


def test_prefix_replay_page_draws_each_frames_specs(tmp_path, browser, shots, tiny):
    for policy in ("hash", "radix"):
        pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=8, policy=policy)
        for q in QUESTIONS:
            pool.serve(SYSTEM + q, max_new_tokens=4)
        frames = pool.frames()
        path = kvexplore.replay.save_prefix_html(pool, tmp_path / f"prefix_{policy}.html")
        page = browser.new_page()
        outside = []
        try:
            page.set_viewport_size({"width": 1280, "height": 1000})
            page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:")
                       else (outside.append(r.request.url), r.abort()))
            page.goto(path.as_uri())
            root = page.locator(".kvx-prefix-page").first
            page.wait_for_function(READY, arg=root.element_handle(), timeout=120_000)
            assert root.evaluate("(r) => r.dataset.kvxError || null") is None
            assert root.evaluate("(r) => r.querySelector('.kvx-slider').max") == str(len(frames) - 1)
            for i in (len(frames) - 1, *range(len(frames))):
                root.evaluate("(r, i) => { const s = r.querySelector('.kvx-slider'); s.value = String(i); "
                              "s.dispatchEvent(new Event('input')); }", i)
                page.wait_for_function(f"(r) => r.dataset.kvxFrame === '{i}'", arg=root.element_handle())
                specs = {n: {"traces": plain(s.traces), "layout": plain(s.layout)}
                         for n, s in figures(frames, i).items()}
                diff = mismatches({"specs": specs}, {"figures": page_figures(root)}, list(NAMES))
                assert not diff, f"{policy} frame {i}:\n  " + "\n  ".join(diff[:20])
                assert frames[i].title in root.locator(".kvx-label").inner_text()
                if i == 3:
                    screenshot(page, shots / f"prefix_replay_{policy}_frame3.png", full_page=True)
            assert outside == []
            # the address bar is the link to the view shown, and a link opens its step
            assert page.evaluate("location.hash") == f"#step={len(frames) - 1}"
            page.goto("about:blank")  # (a new load: a change of the hash alone does not reload the page)
            page.goto(path.as_uri() + "#step=2")
            page.wait_for_function(READY, arg=root.element_handle(), timeout=120_000)
            assert root.evaluate("(r) => [r.dataset.kvxFrame, r.querySelector('.kvx-slider').value]") == ["2", "2"]
            assert frames[2].title in root.locator(".kvx-label").inner_text()
            page.goto("about:blank")
            page.goto(path.as_uri() + "#step=99")  # a step the run does not have: the run as it ended
            page.wait_for_function(READY, arg=root.element_handle(), timeout=120_000)
            assert root.evaluate("(r) => r.dataset.kvxFrame") == str(len(frames) - 1)
        finally:
            page.close()


COMPARE = (f"import kvexplore\nmodel = kvexplore.load('tiny')\npools = [kvexplore.PrefixPool(model, num_blocks=10, "
           f"block_size=8, policy=p) for p in ('hash', 'radix')]\nfor q in {QUESTIONS!r}:\n"
           f"    kvexplore.PrefixPool.serve_each(pools, {SYSTEM!r} + q, max_new_tokens=4)\n"
           f"both = kvexplore.PrefixCompare(pools)\nboth")


@LAB
def test_lab_pools_side_by_side_page_equals_kernel(lab, lab_page, browser, shots):
    """Two pools (hash, radix; a pool small enough to evict) under one slider: after the first draw, after slider
    moves and after both serve one more request from the kernel, each view's figures in the page equal its kernel."""
    name = "truth_lab_prefix_compare"
    with _run(lab, lab_page, name, COMPARE, 1600) as page:
        both = page.locator(".kvx-prefix-compare").first
        try:
            both.wait_for(timeout=120_000)
            roots = [both.locator(".kvx-prefix-view").nth(i) for i in range(2)]
            for root in roots:
                _drawn(root)
                assert _agree(page, root, True, "display")["frame"] == 4
            _shot(page, both, shots / f"{name}_1600x1000_last.png")
            for frame in (3, 2):
                _slide(page, both, "ArrowLeft")
                for root in roots:
                    _kernel_at(page, root, frame)
                    _agree(page, root, True, f"slider to frame {frame}")
                page.wait_for_timeout(PAUSE_MS)
            page.evaluate("""() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel
                .requestExecute({code: "kvexplore.PrefixPool.serve_each(pools, 'You are a terse guide at the whale "
                                 + "museum. Where is the gift shop?', max_new_tokens=4)"}).done.then(() => true)""")
            for root in roots:
                _kernel_at(page, root, 5, 6)
                _agree(page, root, True, "a request served live to both")
            _shot(page, both, shots / f"{name}_1600x1000_live.png")
        except Exception:
            screenshot(page, shots / f"{name}_FAILED.png")
            raise


def test_side_by_side_replay_page_draws_each_pools_frame_under_one_slider(tmp_path, browser, shots, tiny):
    pools = [kvexplore.PrefixPool(tiny, num_blocks=16, block_size=8, policy=p) for p in ("hash", "radix")]
    for q in QUESTIONS:
        kvexplore.PrefixPool.serve_each(pools, SYSTEM + q, max_new_tokens=4)
    path = kvexplore.replay.save_prefix_html(pools, tmp_path / "side_by_side.html")
    page = browser.new_page()
    try:
        page.set_viewport_size({"width": 1600, "height": 1000})
        page.route("**/*", lambda r: r.continue_() if r.request.url.startswith("file:") else r.abort())
        page.goto(path.as_uri())
        root = page.locator(".kvx-prefix-compare-page").first
        page.wait_for_function(READY, arg=root.element_handle(), timeout=120_000)
        assert root.evaluate("(r) => r.dataset.kvxError || null") is None
        columns = [root.locator(".kvx-columns > .kvx-prefix-page").nth(k) for k in range(2)]
        for i in (2, 0, 4, 3):
            root.evaluate("(r, i) => { const s = r.querySelector('.kvx-slider'); s.value = String(i); "
                          "s.dispatchEvent(new Event('input')); }", i)
            page.wait_for_function(f"(r) => r.dataset.kvxFrame === '{i}'", arg=root.element_handle())
            for pool, column in zip(pools, columns):
                assert column.evaluate("(r) => r.dataset.kvxFrame") == str(i)
                specs = {n: {"traces": plain(s.traces), "layout": plain(s.layout)}
                         for n, s in figures(pool.frames(), i).items()}
                diff = mismatches({"specs": specs}, {"figures": page_figures(column)}, list(NAMES))
                assert not diff, f"{pool.policy} frame {i}:\n  " + "\n  ".join(diff[:20])
            if i == 3:
                screenshot(page, shots / "prefix_replay_side_by_side_frame3.png", full_page=True)
    finally:
        page.close()
