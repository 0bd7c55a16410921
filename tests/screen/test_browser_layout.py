"""The explorer's layout holds in a real browser at 1280 x 800 and 1920 x 1080, without and with presentation mode,
for every view and every kind of lane: no text box overlaps another, no title, label or table is clipped or runs off
the screen, the plot areas keep their share of each figure, no legend has to scroll, and presenting sets every
text to 18 px at least (:mod:`browser_layout` measures the page). Screenshots of every look go to
``$KVX_SCREENSHOTS`` (``layout_*.png``).

The tiny model here, with an exact, a paged, an evicting and a drafting lane, on both screens; SmolLM2 beside an
evicting lane and Gemma 3 at 2,000 tokens on the projector's (1280 x 800), plain and presenting.
"""

from __future__ import annotations

import json

import pytest

from browser_layout import SIZES, check_layout
from test_browser_truth import LAB, VIEWPORT, _notebook
from browser_support import start_run_all, wait_run_finished

pytestmark = pytest.mark.browser

SPEC = {"draft": "prompt-lookup", "draft_tokens": 4}
REPEATED = ("The whale swam under the ship while the crew slept, and the sea was calm. The whale swam under the "
            "ship while the crew slept, and the sea was calm. The whale swam")


def _lab_layout(lab, lab_page, shots, name: str, source: str, lanes: dict[str, tuple[str, ...]],
                sizes: tuple[dict, ...] = SIZES) -> list[str]:
    """Run a notebook of one cell (``source`` shows an explorer) in the run's JupyterLab and look at its layout at
    each of ``sizes``."""
    _notebook(lab.root / f"{name}.ipynb", source)
    with lab_page.notebook(f"{name}.ipynb", VIEWPORT) as page:
        start_run_all(page)
        assert not wait_run_finished(page)
        explorer = page.locator(".kvx-explorer").first
        explorer.locator(".js-plotly-plot").first.wait_for(timeout=300_000)
        looked = check_layout(page, explorer, shots, name.removeprefix("layout_"), lanes=lanes, sizes=sizes)
    (shots / f"{name}_looks.json").write_text(json.dumps(looked, indent=1))
    return looked


@LAB
def test_every_view_and_lane_kind_fits_both_screens_and_presentation(lab, lab_page, browser, shots):
    every = ("Attention", "Memory", "Stored K/V", "Compare strategies", "Press scores", "Held per head", "Eviction",
             "Speculation")
    looked = _lab_layout(lab, lab_page, shots, "layout_tiny",
                         "import kvexplore\n"
                         f"ex = kvexplore.Explorer('tiny', strategies=('preallocated', 'paged', 'evict', "
                         f"'preallocated@spec', 'quantized'), max_seq_len=128, strategy_options={{'paged': "
                         f"{{'block_size': 8}}, 'preallocated@spec': {SPEC!r}, 'quantized': {{'key_bits': 2, "
                         f"'group_size': 8, 'residual': 4}}}}, prompt={REPEATED!r})\nex.run(6)\nex",
                         {"preallocated": every, "paged": ("Attention",),
                          "evict": ("Attention", "Press scores", "Held per head"),
                          "preallocated@spec": ("Attention", "Speculation"),
                          "quantized": ("Stored K/V",)})  # its error per position and per channel
    assert len(looked) == 2 * (2 * (len(every) + 1 + 3 + 2 + 1) + 5), looked  # presenting, each lane's map too


EXACT_TABS = ("Attention", "Memory", "Stored K/V", "Compare strategies")
# the real models are looked at on the projector's screen only (the smaller, where text runs out of room first): the
# tiny model's test above covers both screens for every view and lane kind, and each look at a real model costs
# seconds of repainting
PROJECTOR = SIZES[:1]


@LAB
@pytest.mark.smollm2
def test_smollm2_with_an_evicting_lane_fits(lab, lab_page, browser, shots):
    """SmolLM2 (30 layers, 9 query heads on 3 KV heads) beside an evicting lane, its chat prompt in the strip."""
    from test_browser_truth import _smollm2

    _smollm2()
    looked = _lab_layout(lab, lab_page, shots, "layout_smollm2",
                         "import kvexplore\n"
                         "ex = kvexplore.Explorer('smollm2-135m', strategies=('preallocated', 'evict'), "
                         "max_seq_len=160, prompt='Why is the sky blue? Answer in two sentences.', chat=True)\n"
                         "ex.run(6)\nex",
                         {"preallocated": EXACT_TABS + ("Eviction",),
                          "evict": ("Attention", "Press scores", "Held per head")}, PROJECTOR)
    assert len(looked) == 2 * 8 + 2, looked


@LAB
@pytest.mark.gemma3
def test_gemma3_at_two_thousand_tokens_fits(lab, lab_page, browser, shots):
    """Gemma 3 270M over 2,000 tokens of a chapter: rings of 512 slots beside the global layers, binned views."""
    from gemma3_support import require_gemma3

    require_gemma3()
    looked = _lab_layout(lab, lab_page, shots, "layout_gemma3",
                         "from pathlib import Path\nimport kvexplore\n"
                         "gemma = kvexplore.load('gemma3-270m')\n"
                         "text = (Path(kvexplore.__file__).parent / 'data' / 'texts' / "
                         "'moby_dick_chapter_4.txt').read_text()\n"
                         "ids = [gemma.tokenizer.bos_id, *gemma.tokenizer.encode(text)][:2000]\n"
                         "ex = kvexplore.Explorer(gemma, strategies=('preallocated',), max_seq_len=2048, prompt=ids)\n"
                         "ex.run(2)\nex",
                         {"preallocated": EXACT_TABS}, PROJECTOR)
    assert len(looked) == 2 * 4 + 1, looked


def _chapter(chars: int = 10807) -> str:
    """A passage a teacher pastes: the first ``chars`` characters of the GPL-3 text Debian ships (2,343 SmolLM2
    tokens), else the packaged Moby Dick chapter repeated."""
    from pathlib import Path

    import kvexplore

    gpl = Path("/usr/share/common-licenses/GPL-3")
    text = gpl.read_text() if gpl.exists() else (
        Path(kvexplore.__file__).parent / "data" / "texts" / "moby_dick_chapter_4.txt").read_text() * 3
    return text[:chars]


@pytest.mark.smollm2
def test_the_smollm2_app_with_a_pasted_chapter_equals_the_kernel_shows_progress_and_fits(browser, shots, tmp_path):
    """``kvexplore app`` as a teacher runs it: SmolLM2 and the default lanes (preallocated, concat, paged). The app
    shows no code, fits one screen and equals the kernel; then a 2,343-token paste (its progress shown while it runs):
    the caches grow from the app's 128 slots to hold it and the page equals the kernel; then two Steps, each equal to
    the kernel, the newest token inside the strip's box; every tab and the paged lane's map at both screens, plain and
    presenting, presenting on one 1280 x 800 screen (Step and the tab's figure under the app's header, the page as it
    opens); then the two cache maps side by side, plain and presenting."""
    from playwright.sync_api import expect

    from browser_explorer import _checks
    from browser_support import figure, new_page, open_voila_app, require_browser, screenshot, voila_server
    from test_browser_truth import _on_one_screen, _shows_no_code, _smollm2

    require_browser("voila", "ipywidgets", "plotly", "anywidget")
    _smollm2()
    done = []
    with voila_server(tmp_path, model="smollm2-135m") as server:
        page = new_page(browser)
        try:
            page.set_viewport_size(SIZES[0])
            explorer = open_voila_app(page, server, timeout_s=300)
            _shows_no_code(page)
            figure(explorer, "cache_map").wait_for(timeout=300_000)
            _on_one_screen(page, explorer)
            expect(page.locator(".kvx-static:visible")).to_have_count(0)  # the static copy is for kernel-less pages
            check, click = _checks(page, explorer, False, done, pause_ms=300)  # pauses as a teacher's
            check("display")
            explorer.locator(".kvx-prompt textarea").first.fill(_chapter())  # pasted, then Prefill
            explorer.locator(".kvx-prefill").first.click()
            # while it runs the page says what is happening: the new prompt, the lane and layer, a bar
            status = explorer.locator(".kvx-status").first
            status.locator("text=prefilling the new prompt (2,343 tokens)").wait_for(timeout=120_000)
            assert explorer.locator(".kvx-progress").first.is_visible()
            page.wait_for_function("(root) => !root.querySelector('.kvx-step').disabled",
                                   arg=explorer.element_handle(), polling=200, timeout=300_000)
            status.locator("text=2,344 tokens (2,343 prompt)").wait_for(timeout=60_000)  # the refresh after it
            state = check("prefill the pasted chapter")
            assert state["tokens"] == 2344, state["tokens"]
            assert "the caches grew from 128 to" in status.inner_text(), status.inner_text()
            for i in (1, 2):  # then Steps, as a class does
                click("step", f"step {i} after the chapter")
                strip = explorer.locator(".kvx-tokens .kvx-strip").first.bounding_box()
                last = explorer.locator(".kvx-tokens .kvx-last").first.bounding_box()
                assert strip["y"] <= last["y"] and last["y"] + last["height"] <= strip["y"] + strip["height"] + 1, \
                    f"step {i}: the newest token is outside the strip's box: {last} in {strip}"
            status.locator("text=step 2 · 2,346 tokens").wait_for(timeout=60_000)
            screenshot(page, shots / "app_chapter_1280x800.png")
            looked = check_layout(page, explorer, shots, "app_chapter",
                                  {"preallocated": EXACT_TABS, "paged": ("Attention",)}, one_screen=True)
            explorer.locator(".kvx-side-by-side input").first.check()  # preallocated above paged
            looked += check_layout(page, explorer, shots, "app_chapter_side_by_side", {"preallocated": ("Attention",)},
                                   one_screen=True)
        except Exception:
            screenshot(page, shots / "app_chapter_FAILED.png")
            raise
        finally:
            page.close()
    assert len(done) == 4, done
    assert len(looked) == 2 * (2 * (len(EXACT_TABS) + 1) + 2) + 2 * 3, looked
    (shots / "app_chapter_checks.json").write_text(json.dumps(done, indent=1))
