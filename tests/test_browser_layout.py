"""The explorer's layout holds in a real browser at 1280 x 800 and 1920 x 1080, without and with presentation mode,
for every view and every kind of lane: no text box overlaps another, no title, label or table is clipped or runs off
the screen, the plot areas keep their share of each figure, no legend has to scroll, and presenting sets every
text to 18 px at least (:mod:`browser_layout` measures the page). Screenshots of every look go to
``$KVX_SCREENSHOTS`` (``layout_*.png``).

The tiny model here, with an exact, a paged, an evicting and a drafting lane; SmolLM2's lanes and Gemma 3 at
thousands of tokens are looked at the same way at the end of their page-equals-kernel tests
(``tests/test_browser_truth.py``).
"""

from __future__ import annotations

import json

import pytest

from browser_layout import check_layout
from test_browser_truth import LAB, VIEWPORT, _notebook
from browser_support import start_run_all, wait_run_finished

pytestmark = pytest.mark.browser

SPEC = {"draft": "prompt-lookup", "draft_tokens": 4}
REPEATED = ("The whale swam under the ship while the crew slept, and the sea was calm. The whale swam under the "
            "ship while the crew slept, and the sea was calm. The whale swam")


@LAB
def test_every_view_and_lane_kind_fits_both_screens_and_presentation(lab, lab_page, browser, shots):
    name = "layout_tiny"
    _notebook(lab.root / f"{name}.ipynb",
              "import kvexplore\n"
              f"ex = kvexplore.Explorer('tiny', strategies=('preallocated', 'paged', 'evict', 'preallocated@spec'), "
              f"max_seq_len=128, strategy_options={{'paged': {{'block_size': 8}}, 'preallocated@spec': {SPEC!r}}}, "
              f"prompt={REPEATED!r})\nex.run(6)\nex")
    with lab_page.notebook(f"{name}.ipynb", VIEWPORT) as page:
        start_run_all(page)
        assert not wait_run_finished(page)
        explorer = page.locator(".kvx-explorer").first
        explorer.locator(".js-plotly-plot").first.wait_for(timeout=120_000)
        every = ("Attention", "Memory", "Stored K/V", "Compare strategies", "Press scores", "Held per head",
                 "Eviction", "Speculation")
        looked = check_layout(page, explorer, shots, "tiny", lanes={
            "preallocated": every, "paged": ("Attention",), "evict": ("Attention", "Press scores", "Held per head"),
            "preallocated@spec": ("Attention", "Speculation")})
    assert len(looked) == 2 * 2 * (len(every) + 1 + 3 + 2), looked
    (shots / f"{name}_looks.json").write_text(json.dumps(looked, indent=1))
