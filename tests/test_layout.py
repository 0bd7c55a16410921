"""The package's shape, checked from its source: imports run one way through an ordered list of folders, no file
grows past 400 lines, and no code outside the registries decides by a layer kind's or a strategy's name.

The order of the folders is documented in docs/extending.md; this list is the one the suite holds it to."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kvexplore"

#: lowest first: a folder imports only from folders before it (and from itself); folders on one line are siblings
#: and import neither each other. "errors" is the root module kvexplore/errors.py, "kvexplore" the package's
#: __init__ (the public API), which sits on top.
LAYERS: list[tuple[str, ...]] = [
    ("errors",), ("core",), ("config",), ("caches",), ("models",), ("formats",), ("trace",), ("runtime",), ("hf", "prefix"),
    ("diagnosis",), ("views",), ("explorer", "replay"), ("cli",), ("kvexplore",),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def folder_of(module: str) -> str:
    """``kvexplore.caches.base`` -> ``caches``; ``kvexplore.errors`` -> ``errors``; ``kvexplore`` -> ``kvexplore``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "kvexplore"


def module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imports(path: Path) -> list[tuple[int, str]]:
    """Every kvexplore module ``path`` imports, at the top or inside a function: ``(line, module)``."""
    name, is_pkg = module_name(path)
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "kvexplore"]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                base = node.module or ""
                if base.split(".")[0] != "kvexplore":
                    continue
            else:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            where = PACKAGE.parent / base.replace(".", "/")
            for a in node.names:  # from a package import a module: the module is what is imported
                sub = (where / a.name).is_dir() or (where / f"{a.name}.py").is_file()
                out.append((node.lineno, f"{base}.{a.name}" if sub else base))
    return out


def upward_imports() -> list[str]:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = folder_of(module_name(path)[0]) if path.parent != PACKAGE else \
            ("kvexplore" if path.name == "__init__.py" else path.stem)
        assert here in RANK, f"{path.relative_to(PACKAGE.parent)} is in no layer of LAYERS; add its folder there"
        for line, target in imports(path):
            there = folder_of(target)
            if there == here:
                continue
            if RANK[there] >= RANK[here]:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports {target} ({there})")
    return bad


def test_imports_run_one_way_down_the_folders():
    bad = upward_imports()
    assert not bad, "imports that run up (or sideways) the folder order:\n" + "\n".join(bad)


def test_the_checker_sees_a_lazy_import_that_runs_up(tmp_path, monkeypatch):
    """The checker itself: a function-level import from a higher folder is caught, one from below is not."""
    fake = tmp_path / "kvexplore"
    (fake / "caches").mkdir(parents=True)
    (fake / "runtime").mkdir()
    for p in (fake / "__init__.py", fake / "caches" / "__init__.py", fake / "runtime" / "__init__.py",
              fake / "runtime" / "generator.py", fake / "errors.py"):
        p.write_text("")
    (fake / "caches" / "base.py").write_text("from ..errors import X\n\ndef f():\n    from ..runtime import generator\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert upward_imports() == ["kvexplore/caches/base.py:4 (caches) imports kvexplore.runtime.generator (runtime)"]


def test_no_file_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"files over 400 lines (split them by what they do): {long}"


#: the only files that may decide by a layer kind's or a strategy's name: the registries (docs/extending.md)
REGISTRIES = {"kvexplore/config/layer_plan.py", "kvexplore/caches/registry.py", "kvexplore/caches/factory.py",
              "kvexplore/config/families.py", "kvexplore/models/architectures/__init__.py",
              "kvexplore/views/registry.py", "kvexplore/explorer/lanes.py", "kvexplore/runtime/executor.py",
              "kvexplore/hf/caches.py"}


def test_no_code_outside_the_registries_decides_by_kind():
    pattern = re.compile(r"(?<!for )\b(kind|strategy) (==|!=|in) ")  # a loop over kinds decides nothing
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
             if str(p.relative_to(PACKAGE.parent)) not in REGISTRIES
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "comparisons of a kind outside the registries:\n" + "\n".join(found)


def test_no_code_probes_a_cache_for_what_it_can_do():
    """What a cache can do beyond the protocol is declared (``cache.eviction``, ``cache.evicts_on_write``,
    ``cache.checkpointing_states()``), not probed with hasattr/getattr; only ``hf/`` (transformers' caches, not ours)
    may probe."""
    pattern = re.compile(r"(hasattr|getattr)\((getattr\()?[\w.]*cache\w*\s*,")
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).parts[0] != "hf"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "a cache probed for a capability (declare it on ModelCache instead):\n" + "\n".join(found)
    assert pattern.search('x = getattr(getattr(cache, "pressplan", None), "decode_every", None)')
    assert pattern.search('if hasattr(lane.cache, "kept_positions"):')
