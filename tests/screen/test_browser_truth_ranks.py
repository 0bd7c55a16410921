"""Lanes over several processes in JupyterLab (``tp:2`` by heads, ``cp:2`` by positions, beside one process's cache):
after every click the page equals the kernel, the Ranks view included; a query head rank 0 does not hold says so; the
layout holds at 1280 x 800, plain and presenting; and a rank killed from outside, as a crash would, gives the page a
red RankError naming the rank within the lane's bound while the other lanes step on, until Reset starts its ranks
again. The driving is ``browser_explorer.py``'s.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from browser_explorer import LAB, _checks, _lab_operations, _notebook, _select, _sequence, _shot, _tab
from browser_layout import SIZES, check_layout

pytestmark = pytest.mark.browser

SOURCE = ("import kvexplore\n"
          "ex = kvexplore.Explorer('tiny', strategies=('preallocated', 'tp:2', 'cp:2'), max_seq_len=96, "
          "strategy_options={'cp:2': {'interleave': 4}, 'tp:2': {'timeout_s': 4}})\nex")
PIDS = ("import json, pathlib\n"
        "pathlib.Path('ranks_pids.json').write_text(json.dumps([p.pid for p in "
        "ex.lanes['tp:2'].generator.executor.leader.processes]))")


def _error_line(explorer) -> str:
    return explorer.locator(".kvx-error").first.inner_text()


@LAB
def test_lanes_over_ranks_page_equals_kernel_and_a_killed_rank_is_said_in_red(lab, lab_page, browser, shots):
    _notebook(lab.root / "ranks_truth.ipynb", SOURCE, PIDS)

    def operations(page, explorer, shots, name):
        done = []
        check, click = _checks(page, explorer, True, done, pause_ms=300)
        check("display")
        _sequence(explorer, click, "The whale swam under the ship while the crew slept")
        _select(explorer, "lane", "tp:2")
        check("strategy tp:2")
        _tab(explorer, check, "Ranks", "ranks", "tab Ranks on tp:2")
        _tab(explorer, check, "Attention", "attention", "tab Attention on tp:2")
        _select(explorer, "head", "5")  # held by rank 1: the figure says so
        state = check("head 5 on tp:2")
        notes = [a["text"] for a in state["specs"]["attention"]["layout"]["annotations"]]
        assert any("query head 5 is not in this lane's records" in t for t in notes), notes
        _select(explorer, "head", "1")
        _select(explorer, "layer", "1")
        check("layer 1 head 1 on tp:2")
        _select(explorer, "lane", "cp:2")
        _tab(explorer, check, "Ranks", "ranks", "tab Ranks on cp:2")
        _shot(page, explorer, shots / f"{name}_1280x800_ranks_cp.png")
        looks = {"tp:2": ("Ranks", "Attention"), "cp:2": ("Ranks", "Attention")}
        looked = check_layout(page, explorer, shots, "ranks", lanes=looks, sizes=(SIZES[0],))
        done += looked
        check("after the layout")

        pid = json.loads((lab.root / "ranks_pids.json").read_text())[0]
        os.kill(pid, signal.SIGKILL)  # a crash of rank 1 of tp:2
        t0 = time.monotonic()
        state = click("step", "step after rank 1 of tp:2 died")
        took = time.monotonic() - t0
        assert took < 15, f"the page took {took:.1f} s to say a rank died"
        line = _error_line(explorer)
        assert "RankError" in line and "rank 1 of 2 stopped (killed by signal 9)" in line, line
        rows = {row[0].replace(" (ref.)", ""): row for row in state["compare"]}
        assert set(rows) == {"preallocated", "tp:2", "cp:2"}
        _shot(page, explorer, shots / f"{name}_1280x800_rank_died.png")
        click("step", "a step without tp:2")
        click("reset", "reset starts its ranks again")
        click("prefill", "prefill after reset")
        click("step", "step with new ranks")
        assert "RankError" not in _error_line(explorer)
        return done

    _lab_operations(lab_page, shots, "ranks_truth", operations, least=20)
