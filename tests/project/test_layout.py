"""The package's shape, checked from its source: imports run one way through an ordered list of folders, no file
grows past 400 lines, and no code outside the registries decides by a layer kind's or a strategy's name.

The order of the folders is documented in docs/extending.md; this list is the one the suite holds it to."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from source_trees import parse, walk

PACKAGE = Path(__file__).resolve().parents[2] / "kvexplore"

#: lowest first: a folder imports only from folders before it (and from itself); folders on one line are siblings
#: and import neither each other. "errors" is the root module kvexplore/errors.py, "kvexplore" the package's
#: __init__ (the public API), which sits on top.
LAYERS: list[tuple[str, ...]] = [
    ("errors",), ("core",), ("config",), ("caches",), ("models",), ("formats",), ("trace",), ("fast",), ("runtime",),
    ("hf", "prefix", "speculation", "compression", "distributed"),
    ("diagnosis",), ("bugs",), ("views",), ("explorer", "replay"), ("course",), ("cli",), ("kvexplore",),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
#: the house by what it is for: the engine (what a decode needs), the labs (each standing on the engine), the screen
#: (drawing, widgets, the command); docs/extending.md's table gives each folder's group
GROUPS = {"engine": ("errors", "core", "config", "caches", "models", "formats", "trace", "fast", "runtime"),
          "labs": ("hf", "prefix", "speculation", "compression", "distributed", "diagnosis", "bugs"),
          "screen": ("views", "explorer", "replay", "course", "cli")}


def folder_of(module: str) -> str:
    """``kvexplore.caches.base`` -> ``caches``; ``kvexplore.errors`` -> ``errors``; ``kvexplore`` -> ``kvexplore``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else "kvexplore"  # python -m kvexplore: the top


def module_name(path: Path) -> tuple[str, bool]:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imports(path: Path, typing: bool = True) -> list[tuple[int, str]]:
    """Every kvexplore module ``path`` imports, at the top or inside a function (and under ``if TYPE_CHECKING:``
    unless not ``typing``): ``(line, module)``."""
    name, is_pkg = module_name(path)
    package = name if is_pkg else name.rpartition(".")[0]
    out = []
    text = path.read_text()
    skip = set() if typing else {id(n) for node in walk(text) if isinstance(node, ast.If)
                                 and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                                 for n in ast.walk(node)}
    for node in walk(text):
        if id(node) in skip:
            continue
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
            ("kvexplore" if path.name in ("__init__.py", "__main__.py") else path.stem)
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


def test_the_house_reads_engine_then_labs_then_screen():
    """Every folder is in one group, and every folder of a group lies below every folder of the next in the order."""
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(set(RANK) - {"kvexplore"}) and len(grouped) == len(set(grouped))
    tops = [max(RANK[n] for n in names) for names in GROUPS.values()]
    bottoms = [min(RANK[n] for n in names) for names in GROUPS.values()]
    assert all(top < bottom for top, bottom in zip(tops, bottoms[1:])), (tops, bottoms)
    extending = (PACKAGE.parent / "docs" / "extending.md").read_text()
    for group, names in GROUPS.items():
        for name in names:
            folder = f"`{name}.py`" if name == "errors" else f"`{name}/`"
            assert any(folder in line and f"| {group} |" in line for line in extending.splitlines()), (group, name)


PLAIN_DECODE = """
import sys
import kvexplore as kx
model = kx.load("tiny")
g = kx.Generator(model, kx.make_cache("preallocated", model, max_seq_len=64))
g.prefill("a b c")
list(g.run(4))
loaded = [m for name, m in sys.modules.items() if name.startswith("kvexplore") and getattr(m, "__file__", None)]
folders = sorted({name.split(".")[1] for name in sys.modules if name.startswith("kvexplore.")})
print(sum(sum(1 for _ in open(m.__file__)) for m in loaded), "torch._inductor" in sys.modules,
      "torch._dynamo" in sys.modules, *folders)
"""


def test_a_plain_decode_loads_a_small_engine_only():
    """Issue 59's measure: the labs and the screen load on first use, so a plain decode imports none of their folders,
    nor the speed stack (kvexplore.fast), nor inductor or dynamo, and at most 12,000 lines of kvexplore's own modules
    (tests/engine/test_products.py checks that the models' files name no kernel)."""
    import subprocess
    import sys

    lines, inductor, dynamo, *folders = subprocess.run([sys.executable, "-c", PLAIN_DECODE], capture_output=True,
                                                       text=True, check=True).stdout.split()
    assert (inductor, dynamo) == ("False", "False")
    assert folders and set(folders) <= set(GROUPS["engine"]) - {"fast"}, folders
    assert int(lines) <= 12_000, f"a plain decode loads {lines} lines of kvexplore"


def test_the_checker_sees_a_lazy_import_that_runs_up(tmp_path, monkeypatch):
    """The checker itself: a function-level import from a higher folder is caught, one from below is not."""
    fake = tmp_path / "kvexplore"
    (fake / "caches").mkdir(parents=True)
    (fake / "runtime").mkdir()
    for p in (fake / "__init__.py", fake / "caches" / "__init__.py", fake / "runtime" / "__init__.py",
              fake / "runtime" / "generator.py", fake / "errors.py"):
        p.write_text("")
    (fake / "caches" / "base.py").write_text("from ..errors import X\n\n"
                                             "def f():\n    from ..runtime import generator\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    assert upward_imports() == ["kvexplore/caches/base.py:4 (caches) imports kvexplore.runtime.generator (runtime)"]


def test_no_file_over_400_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"files over 400 lines (split them by what they do): {long}"


#: the only files that may decide by a layer kind's or a strategy's name: the registries (docs/extending.md)
REGISTRIES = {"kvexplore/config/layer_plan.py", "kvexplore/caches/registry.py", "kvexplore/caches/factory.py",
              "kvexplore/config/families.py", "kvexplore/models/architectures/__init__.py",
              "kvexplore/views/registry.py", "kvexplore/explorer/lanes.py", "kvexplore/models/executor.py",
              "kvexplore/hf/caches.py"}


def test_no_code_outside_the_registries_decides_by_kind():
    pattern = re.compile(r"(?<!for )\b(kind|strategy) (==|!=|in) ")  # a loop over kinds decides nothing
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
             if str(p.relative_to(PACKAGE.parent)) not in REGISTRIES
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "comparisons of a kind outside the registries:\n" + "\n".join(found)


def test_no_code_probes_a_cache_for_what_it_can_do():
    """What a cache can do beyond the protocol is declared (``cache.eviction``, ``cache.inspect.evicts_on_write``,
    ``cache.checkpointing_states()``), not probed with hasattr/getattr; only ``hf/`` (transformers' caches, not ours)
    may probe."""
    pattern = re.compile(r"(hasattr|getattr)\((getattr\()?[\w.]*cache\w*\s*,")
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {line.strip()}" for p in sorted(PACKAGE.rglob("*.py"))
             if p.relative_to(PACKAGE).parts[0] != "hf"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "a cache probed for a capability (declare it on ModelCache instead):\n" + "\n".join(found)
    assert pattern.search('x = getattr(getattr(cache, "pressplan", None), "decode_every", None)')
    assert pattern.search('if hasattr(lane.cache, "kept_positions"):')


def private_reaches(package: Path) -> list[str]:
    """``other._name`` (or ``getattr(other, "_name")``) where ``other`` is not ``self``/``cls`` and ``_name`` is a
    private name of this package defined in another module only: one module's internals read or written by another.
    (Private names of other libraries, such as torch's ``_indices``, are theirs to police; ``hf/`` reads
    transformers' objects.)"""
    trees = {p: walk(p.read_text()) for p in sorted(package.rglob("*.py")) if p.parent.name != "hf"}
    defined: dict[Path, set[str]] = {}
    for p, nodes in trees.items():
        names = defined[p] = set()
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in ("self", "cls") and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):  # a dataclass field
                names.add(node.target.id)
    ours = set().union(*defined.values())
    found = []
    for p, nodes in trees.items():
        for node in nodes:
            if isinstance(node, ast.Attribute):
                owner, name = node.value, node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in \
                    ("getattr", "hasattr", "setattr") and len(node.args) >= 2 and \
                    isinstance(node.args[1], ast.Constant):
                owner, name = node.args[0], node.args[1].value
            else:
                continue
            if not isinstance(name, str) or not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if name in ours and name not in defined[p]:
                found.append(f"{p.relative_to(package.parent)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_modules_private_state():
    found = private_reaches(PACKAGE)
    assert not found, ("private state of another module read or written (give its owner a public method or "
                       "property):\n" + "\n".join(found))


def test_the_private_checker_sees_a_reach(tmp_path):
    fake = tmp_path / "kvexplore"
    fake.mkdir()
    (fake / "a.py").write_text("class A:\n    def __init__(self):\n        self._rng = 1\n        self._own = 2\n"
                               "    def twin(self, other):\n        return other._own\n")
    (fake / "b.py").write_text("def f(gen, t):\n    t._indices()\n    gen._rng = 3\n    return getattr(gen, '_own')\n")
    assert private_reaches(fake) == ["kvexplore/b.py:3: gen._rng", "kvexplore/b.py:4: getattr(gen, '_own')"]


def import_cycles() -> list[str]:
    """Pairs of modules that import each other when they run (at the top or inside a function; an import for
    annotations only, under ``if TYPE_CHECKING:``, runs nothing)."""
    graph = {module_name(p)[0]: {t for _, t in imports(p, typing=False)} for p in PACKAGE.rglob("*.py")}
    return sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets
                  if a < b and a in graph.get(b, ()))


def test_no_two_modules_import_each_other():
    cycles = import_cycles()
    assert not cycles, "modules that import each other (one concept split across two files?):\n" + "\n".join(cycles)


#: register functions that are not named registries (docs/extending.md): plan rules are an ordered list of
#: functions with no names, and the two page writers are single hooks a higher folder sets
HOOKS = {"register_plan_rule", "register_html_writer", "register_page_writer"}


def test_every_named_registry_follows_the_one_rule():
    """Every ``register*`` function of the package adds through a :class:`kvexplore.core.registry.Registry`
    (a taken name refused unless replace=True, built-ins kept, an unregister beside it)."""
    loose = []
    for p in sorted(PACKAGE.rglob("*.py")):
        tree = parse(p.read_text())
        defs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("register") \
                    or node.name in HOOKS or node.name == "registered":
                continue
            adds = any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "add"
                       for n in ast.walk(node))
            undo = "un" + node.name in defs
            if not (adds and undo):
                loose.append(f"{p.relative_to(PACKAGE.parent)}: {node.name} "
                             f"({'no Registry.add' if not adds else 'no un' + node.name})")
    assert not loose, "registries outside the one rule (kvexplore/core/registry.py):\n" + "\n".join(loose)
