"""What the explorer's tests share (tests/screen/test_explorer.py, tests/screen/test_explorer_steps.py and
tests/screen/test_explorer_views.py): the trained tiny model (the ``model`` fixture, imported by name into each test
module), a prompt, an explorer of three lanes over a 48-slot cache, and the helpers that click its buttons and read its
cache map and figures. Importing it skips the importing module when the notebook extra (plotly, ipywidgets) is
missing."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly", reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")
pytest.importorskip("ipywidgets")

import kvexplore  # noqa: E402
from kvexplore.views.palette import SLOT_CLASSES  # noqa: E402
from kvexplore.views.spec import grid  # noqa: E402

CODE = {name: i for i, name in enumerate(SLOT_CLASSES)}
PROMPT = "Call me Ishmael. Some years ago"


@pytest.fixture(scope="module")
def model(trained):
    return trained


def explorer(model, **kw):
    kw.setdefault("strategies", ("preallocated", "concat", "paged"))
    kw.setdefault("max_seq_len", 48)
    kw.setdefault("strategy_options", {"paged": {"block_size": 8}} if "paged" in kw["strategies"] else None)
    return kvexplore.Explorer(model, **kw)


def slot_rows(ex):
    return grid(ex.figures["cache_map"].data[0])


def slot_row(ex, layer=0):
    return [int(v) for v in slot_rows(ex)[layer]]


def shown(ex, view):
    """The figure of a tab's view, with that tab picked (a view off screen is drawn when its tab is picked)."""
    ex.view = view
    return ex.figures[view]


def click(ex, name):
    ex.controls[name].click()
