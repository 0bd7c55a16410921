"""The course's prose names the explorer's views by the labels the widget shows.

A tab's label is its view's title in :mod:`kvexplore.views.registry` (``VIEWS[name].title`` for each name in
``TABS``); the cache map, always on screen, is named by its title too. A notebook that sends a student to the
"Memory per step" view while the tab reads "Memory" has them look for a tab that is not there. These checks read the
notebooks' JSON (markdown cells only) and the course README: no kernel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvexplore.views.registry import TABS, VIEWS

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ALL = sorted(NOTEBOOKS.glob("*.ipynb"))

# the views' names before the tabs were named from the registry (the widget's headings then): none is a label now
STALE = ("Memory per step", "Stored keys and values", "Strategies compared", "Cache map — layers × physical slots")

# a name set off by bold, italics, quotes or backticks, followed by "tab(s)" or "view(s)": "the **Memory** tab",
# "the `compare` view", "the "Stored K/V" tab's heatmap". A tab is always the widget's; a view may be a tensor's
# ("the *write* view"), so a view is checked where its name reads like a view's: capitalised, or a bare identifier
# in code (a registry name)
_MARKED = (r"\*\*(?P<bold>[^*\n]+?)\*\*|(?<![\w*])\*(?P<italic>[^*\n]+?)\*(?![\w*])|\"(?P<quote>[^\"\n]+?)\""
           r"|“(?P<curly>[^”\n]+?)”|`(?P<code>[^`\n]+?)`")
NAMED = re.compile(rf"(?:{_MARKED})\s+(?P<kind>tabs?|views?)\b", re.I)
MARKED = re.compile(_MARKED)


def tab_labels() -> set[str]:
    """What the widget's tabs read."""
    return {VIEWS[name].title for name in TABS}


def view_titles() -> set[str]:
    """Every view's title, the tabs' and the cache maps'."""
    return {view.title for view in VIEWS.values()}


def prose(path: Path) -> str:
    """A notebook's markdown cells (or a markdown file), joined; fenced code left out."""
    if path.suffix == ".md":
        text = path.read_text()
    else:
        cells = json.loads(path.read_text())["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return re.sub(r"```.*?```", "", text, flags=re.S)


def wrong_names(text: str) -> list[str]:
    """What in ``text`` names a view by a name the widget does not show, one line per finding (empty: none)."""
    labels, titles = tab_labels(), view_titles()
    found = []
    for stale in STALE:
        if stale in text:
            found.append(f"{stale!r} is an old name (the tabs read: {', '.join(sorted(labels))})")
    for m in MARKED.finditer(text):
        name = next(v for k, v in m.groupdict().items() if v is not None)
        if name.strip().lower() in {s.lower() for s in STALE} and name.strip() not in STALE:
            found.append(f"{name!r} is an old name (the tabs read: {', '.join(sorted(labels))})")
    for m in NAMED.finditer(text):
        kind = m["kind"].lower().rstrip("s")
        name = next(m[k] for k in ("bold", "italic", "quote", "curly", "code") if m[k] is not None).strip()
        if kind == "view" and not (re.fullmatch(r"[a-z_][a-z0-9_]*", name) if m["code"] else name[:1].isupper()):
            continue  # a tensor's view ("the *write* view", "`k.narrow(2, 0, n)` view"): views' names read otherwise
        if m["code"] is not None:  # code names a view by its registry name (ex.view = "compare") or its title
            ok = name in VIEWS or name in titles
        else:
            ok = name in (labels if kind == "tab" else titles)
        if not ok:
            real = labels if kind == "tab" else titles
            found.append(f"the {name!r} {kind} is not one the widget shows ({', '.join(sorted(real))})")
    return found


def test_the_labels_come_from_the_registry_and_no_stale_name_is_one():
    labels = tab_labels()
    assert {"Attention", "Memory", "Stored K/V", "Compare strategies"} <= labels  # the tabs every lane set has
    assert not labels & set(STALE), "a stale name is a tab label again: take it out of STALE"


def test_the_check_can_fail():
    """The checker on made-up prose: old names, a bold tab that does not exist and a code name that is no view are
    found; the real labels, registry names and text that only mentions memory are not."""
    bad = ("Open the **Memory per step** view. The **Strategies** tab compares them; see the `comparison` view "
           "and the \"Stored keys\" tab, and *strategies compared* in the list.")
    found = wrong_names(bad)
    for name in ("'Memory per step'", "'Strategies'", "'comparison'", "'Stored keys'", "'strategies compared'"):
        assert any(name in f for f in found), (name, found)
    good = ("The **Memory** tab's lines, the **Compare strategies** tab, the \"Stored K/V\" tab, the `compare` view, "
            "the **Cache map** view, the attention view; the memory per step of a cache; the strategies compared "
            "below; a **bold** word and the `paged` strategy; the *write* view and the `k.narrow(2, 0, n)` view "
            "of a tensor.")
    assert wrong_names(good) == []


@pytest.mark.parametrize("path", ALL + [NOTEBOOKS / "README.md"], ids=lambda p: p.stem)
def test_the_prose_names_views_as_the_tabs_do(path):
    found = wrong_names(prose(path))
    assert not found, f"{path.name}: " + "; ".join(found)
