"""Browser truth for a speculative lane: in the run's JupyterLab, an explorer with a lane that drafts (prompt lookup)
beside the plain pre-allocated cache; after a prefill, Steps (each one verification), a Run, the Speculation tab, the
lane pick, a rewind across verifications and a step after it, the page's plotly figures (``gd.data``) equal what the
kernel holds, and the Speculation figure in the page holds the generator's own counts. Screenshots of the lane go to
``$KVX_SCREENSHOTS``."""

from __future__ import annotations

from pathlib import Path

import pytest

from browser_truth import page_truth
from test_browser_truth import (LAB, _checks, _idle, _kernel_until, _lab_operations, _notebook, _select, _set,
                                _shot, _tab)

pytestmark = pytest.mark.browser

SOURCE = ('import kvexplore\n'
          'ex = kvexplore.Explorer("tiny", strategies=("preallocated@spec", "preallocated", "sink@spec"), '
          'max_seq_len=96, strategy_options={"preallocated@spec": {"draft": "prompt-lookup", "draft_tokens": 4}, '
          '"sink@spec": {"window": 8, "sinks": 2, "draft": "prompt-lookup"}})\nex')
PROMPT = ("The whale swam under the ship while the crew slept, and the sea was calm. The whale swam under the ship "
          "while the crew slept, and the sea was calm. The whale swam")


def _counts_in_page(explorer, state: dict, label: str) -> None:
    """The Speculation figure in the page holds the kernel's counts of the lane shown (``state["speculation"]``,
    read from ``generator.speculation``, not from the figure)."""
    truth = state["speculation"]
    fig = {t.get("name"): t for t in page_truth(explorer)["figures"]["speculation"]["data"]}
    got = dict(zip(fig["accepted"]["x"], fig["accepted"]["y"]))
    want = {v["last_step"]: v["accepted"] for v in truth["verifications"]}
    assert got == want, (label, got, want)
    rejected = dict(zip(fig["rejected"]["x"], fig["rejected"]["y"]))
    assert rejected == {v["last_step"]: v["drafted"] - v["accepted"] for v in truth["verifications"]}, label
    assert sum(fig["tokens per pass"]["y"]) == truth["generated"], label


@LAB
def test_lab_speculative_lane_page_equals_kernel(lab, lab_page, browser, shots):
    name = "truth_lab_speculative"
    _notebook(lab.root / f"{name}.ipynb", SOURCE)
    _lab_operations(lab_page, shots, name, _operations, 12)


def _operations(page, explorer, shots: Path, name: str) -> list[str]:
    done = []
    check, _ = _checks(page, explorer, True, done)

    def click(button: str, label: str, reached) -> dict:
        """Click, wait until the kernel's state shows the click (``reached``), then the page must equal it."""
        explorer.locator(f".kvx-{button}").first.click()
        _kernel_until(explorer, reached, label)
        return check(label)

    check("display")
    _set(explorer, "prompt", PROMPT)
    state = click("prefill", "prefill", lambda s: s["tokens"] > 0)
    state = _tab(explorer, check, "Speculation", "speculation", "tab Speculation")
    _counts_in_page(explorer, state, "after prefill")
    for i in range(3):
        n = state["tokens"]
        state = click("step", f"step {i + 1} (one verification)", lambda s, n=n: s["tokens"] > n)
        _counts_in_page(explorer, state, f"step {i + 1}")
    _shot(page, explorer, shots / f"{name}_1280x800_speculation_steps.png")
    _set(explorer, "run-n", "4")
    n = state["tokens"]
    state = click("run", "run 4", lambda s: s["tokens"] >= n + 4 and s["error"] == "")
    _idle(page, explorer)
    state = check("run 4 finished")
    _counts_in_page(explorer, state, "run 4")
    assert state["speculation"]["verifications"], "the lane verified drafts"
    _shot(page, explorer, shots / f"{name}_1280x800_speculation_run.png")
    _select(explorer, "lane", "sink@spec")
    _kernel_until(explorer, lambda s: s["lane"] == "sink@spec", "the sink lane")
    state = check("strategy sink@spec")
    _counts_in_page(explorer, state, "sink@spec")
    _shot(page, explorer, shots / f"{name}_1280x800_speculation_sink.png")
    _select(explorer, "lane", "preallocated@spec")
    _kernel_until(explorer, lambda s: s["lane"] == "preallocated@spec", "the pre-allocated lane")
    state = check("strategy preallocated@spec")
    n = state["tokens"]
    _set(explorer, "rewind-n", "3")
    state = click("rewind", "rewind 3 (across verifications)", lambda s: s["tokens"] == n - 3)
    _counts_in_page(explorer, state, "rewind 3")
    state = click("step", "step after rewind", lambda s: s["tokens"] > n - 3)
    _counts_in_page(explorer, state, "step after rewind")
    _shot(page, explorer, shots / f"{name}_1280x800_speculation_after_rewind.png")
    _tab(explorer, check, "Attention", "attention", "tab Attention")
    _shot(page, explorer, shots / f"{name}_1280x800_cache_map.png")
    return done
