"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and none is committed with outputs.

The notebooks make their claims with ``assert`` cells ("the tokens are identical", "the storage did not move"),
so executing them is the test. Executed copies go to a temporary folder; the repository's files are never written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
ALL = sorted(NOTEBOOKS.glob("*.ipynb"))


def test_the_course_is_numbered_in_order():
    names = [p.name for p in ALL]
    assert names, "no notebooks found"
    numbers = [int(n.split("_", 1)[0]) for n in names]
    assert numbers == list(range(1, len(names) + 1)), names


@pytest.mark.parametrize("path", ALL, ids=[p.stem for p in ALL])
def test_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, \
                f"{path.name} has stored outputs: clear them (jupyter nbconvert --clear-output --inplace {path.name})"
    assert "widgets" not in nb.get("metadata", {}), f"{path.name} stores widget state: clear it"


def _real_models(path: Path) -> list:
    """The markers of the real models a notebook loads (a notebook using Gemma 3 skips where it cannot be had:
    see ``executed_notebook``)."""
    text = path.read_text()
    return [mark for name, mark in (("smollm2", pytest.mark.smollm2), ("gemma3-270m", pytest.mark.gemma3))
            if name in text]


@pytest.mark.notebooks
@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem, marks=_real_models(p)) for p in ALL])
def test_notebook_runs(path, executed_notebook):
    """Executed once per run (``executed_notebook``); the copy is shared with the tests that render and export it."""
    nbformat = pytest.importorskip("nbformat",
                                   reason="the notebook extra is not installed: pip install -e '.[notebook,dev]'")
    copy, run = executed_notebook(path)
    assert run["error"] is None, f"{path.name} failed: {run['error']}"
    nb = nbformat.read(copy, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code" and c.source.strip()), \
        "a cell did not run"


def _links(text: str) -> list[str]:
    """The targets of the markdown links ``[text](target)`` in ``text``."""
    import re

    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_course_reads_as_one_and_its_links_work_from_the_copied_folder(tmp_path):
    """Every relative link in a notebook's markdown or the course's README resolves in the folder ``kvexplore lab``
    copies them to; each notebook ends with a link to the next one and to the README (the last back to the tour),
    and the tour's "Where next" lists every other notebook."""
    from kvexplore.cli import launch

    launch.copy_notebooks(tmp_path)
    copied = sorted(p.name for p in tmp_path.iterdir())
    assert copied == sorted([p.name for p in ALL] + ["README.md"])
    texts = {"README.md": (NOTEBOOKS / "README.md").read_text()}
    for path in ALL:
        cells = json.loads(path.read_text())["cells"]
        texts[path.name] = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        last = "".join(cells[-1]["source"])
        following = ALL[(ALL.index(path) + 1) % len(ALL)].name
        if path != ALL[0]:
            assert cells[-1]["cell_type"] == "markdown" and f"]({following})" in last and "](README.md)" in last, \
                f"{path.name} does not end with its next step"
    tour = texts[ALL[0].name].split("## Where next")[1]
    assert [t for t in _links(tour) if t.endswith(".ipynb")] == [p.name for p in ALL[1:]]
    for name, text in texts.items():
        for target in _links(text):
            if "://" in target or target.startswith("#"):
                continue
            assert (tmp_path / target.split("#")[0]).exists(), f"{name} links {target}, missing beside the notebooks"


def test_formulas_render_without_mathjax():
    """An exported notebook (``jupyter nbconvert --to html``) loads MathJax from the network, which a lecture hall may
    not have: the course writes its formulas in HTML (``<sub>``, ``<sup>``, Unicode), never as TeX between ``$``."""
    import re

    for path in ALL + [NOTEBOOKS / "README.md"]:
        if path.suffix == ".md":
            text = path.read_text()
        else:
            text = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                             if c["cell_type"] == "markdown")
        text = re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", text, flags=re.S))  # code is not a formula
        tex = re.findall(r"\$\$.+?\$\$|\$[^$\s][^$\n]*?\$|\\\(|\\\[|\\begin\{", text, flags=re.S)
        assert not tex, f"{path.name} writes a formula in TeX ({tex[0][:60]!r}): write it in HTML so it renders offline"
