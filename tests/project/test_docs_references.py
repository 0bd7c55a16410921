"""The docs cannot drift from the code: every file a page of ``docs/`` names in backticks (``caches/base.py``,
``tests/test_evict.py::test_...``) exists, every dotted name under ``kvexplore.`` it gives imports, and every
``Class.member`` of a class the package exports (``Explorer.prefill``) is there."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
BASES = ("", "kvexplore/", "tests/", "benchmarks/")  # where a path in the docs may start
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^((?:[\w.-]+/)*[\w-]+\.py)(?:::(\w+))?(?::\d+(?:-\d+)?)?$")
DOTTED = re.compile(r"^(kvexplore(?:\.\w+)+)(?:\(.*\))?$")
MEMBER = re.compile(r"^([A-Z]\w+)\.([a-z_]\w*)(?:\(.*\))?$")  # Explorer.prefill: a member of a class kvexplore exports


def _files() -> dict[str, list[Path]]:
    names: dict[str, list[Path]] = {}
    for base in ("kvexplore", "tests", "benchmarks", ".ci"):
        for p in (ROOT / base).rglob("*.py"):
            names.setdefault(p.name, []).append(p)
    return names


def _path_missing(ref: str, test: str | None, names: dict[str, list[Path]]) -> str | None:
    if "/" in ref:
        found = [ROOT / base / ref for base in BASES if (ROOT / base / ref).is_file()]
        if not found:
            found = [p for p in names.get(Path(ref).name, []) if p.as_posix().endswith("/" + ref)]
    else:
        found = names.get(ref, [])
    if not found:
        return f"no file {ref}"
    if test and not any(re.search(rf"^\s*(?:async )?def {test}\b|^{test} = ", p.read_text(), re.M) for p in found):
        return f"{ref} has no {test}"
    return None


def _name_missing(dotted: str) -> str | None:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and any(attr in getattr(k, "__annotations__", {}) for k in obj.__mro__):
                obj = None  # a field without a default (a dataclass's): declared, nothing to look into
            else:
                return f"{'.'.join(parts[:cut])} has no {'.'.join(parts[cut:])}"
        return None
    return f"{dotted} does not import"


def references(text: str):
    for m in CODE.finditer(text):
        code = m.group(1).strip()
        if (p := PATH.match(code)) is not None:
            yield "path", p.group(1), p.group(2)
        elif (d := DOTTED.match(code)) is not None:
            yield "name", d.group(1), None
        elif (c := MEMBER.match(code)) is not None and hasattr(importlib.import_module("kvexplore"), c.group(1)):
            yield "name", f"kvexplore.{c.group(1)}.{c.group(2)}", None


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_code_reference_in_the_docs_resolves(doc):
    pytest.importorskip("plotly", reason="the views' modules need the notebook extra")
    names = _files()
    wrong = []
    for kind, ref, test in references(doc.read_text()):
        why = _path_missing(ref, test, names) if kind == "path" else _name_missing(ref)
        if why:
            wrong.append(f"`{ref}{'::' + test if test else ''}`: {why}")
    assert not wrong, f"{doc.name} names code that is not there (fix the page or the code):\n  " + "\n  ".join(wrong)


def test_the_reference_reader_finds_what_it_should_and_refuses_what_is_not_there():
    found = list(references("`caches/base.py` `tests/test_evict.py::test_x` `kvexplore.caches.registry.STRATEGIES` "
                            "`x = 1` `kvexplore.load(\"tiny\")` `Explorer.prefill(prompt)` `Path.name`"))
    assert found == [("path", "caches/base.py", None), ("path", "tests/test_evict.py", "test_x"),
                     ("name", "kvexplore.caches.registry.STRATEGIES", None), ("name", "kvexplore.load", None),
                     ("name", "kvexplore.Explorer.prefill", None)]
    names = _files()
    assert _path_missing("caches/base.py", None, names) is None
    assert _path_missing("caches/nothing.py", None, names) == "no file caches/nothing.py"
    assert _path_missing("tests/engine/test_registries.py", "test_nothing_here", names) == \
        "tests/engine/test_registries.py has no test_nothing_here"
    assert _name_missing("kvexplore.caches.registry.STRATEGIES") is None
    assert _name_missing("kvexplore.caches.registry.NOTHING") == "kvexplore.caches.registry has no NOTHING"
