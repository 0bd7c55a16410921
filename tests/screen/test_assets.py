"""The widgets' and pages' JavaScript, HTML and CSS are files, not Python strings: every file a module names
(``assets.text(__file__, "player.js")``, ``assets.path(...)``: :mod:`kvexplore.views.assets`) is there, packaged
(pyproject.toml's package-data) and named by some module; each JavaScript file parses; and no module holds a long
string of JavaScript, HTML or CSS again."""

from __future__ import annotations

import ast
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest
from source_trees import walk

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvexplore"
KINDS = (".js", ".css", ".html")
LIMIT = 10  # lines (not counting blank ones): a longer string of code belongs in a file
#: how a string of JavaScript, HTML or CSS starts
STARTS = ("<", "export ", "import ", "function ", "async function", "(function", "const ", "let ", "var ", "//", "/*",
          "@media", "@import")
ENDINGS = ("{", "}", ";", "};", ");", "});", "*/")  # lines of code end so; sentences of prose do not


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def asset_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in KINDS and "__pycache__" not in p.parts)


def named_assets() -> list[tuple[Path, str, int]]:
    """Every ``assets.text(__file__, NAME)`` and ``assets.path(__file__, NAME)`` in the package: (module, NAME,
    line). A call that names its file otherwise fails here (the file could not be checked)."""
    found = []
    for module in modules():
        for node in walk(module.read_text(encoding="utf-8")):
            f = node.func if isinstance(node, ast.Call) else None
            if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "assets"
                    and f.attr in ("text", "path")):
                where = f"{module.relative_to(ROOT)}:{node.lineno}"
                assert len(node.args) == 2 and not node.keywords, f"{where}: assets.{f.attr}(__file__, 'name')"
                first, name = node.args
                assert isinstance(first, ast.Name) and first.id == "__file__", f"{where}: the file beside __file__"
                assert isinstance(name, ast.Constant) and isinstance(name.value, str), f"{where}: name it literally"
                found.append((module, name.value, node.lineno))
    return found


def test_every_file_named_is_there_and_every_file_is_named():
    named = named_assets()
    assert len(named) >= 14  # the widgets' modules, the token strip's and the controls' CSS, the pages and players
    for module, name, line in named:
        assert Path(name).suffix in KINDS and "/" not in name, f"{module.name}:{line}: {name}"
        assert (module.parent / name).is_file(), f"{module.relative_to(ROOT)}:{line} names {name}, not beside it"
    used = {(module.parent / name).resolve() for module, name, _ in named}
    orphans = [str(p.relative_to(ROOT)) for p in asset_files() if p.resolve() not in used]
    assert not orphans, f"no module reads these: {orphans}"


def test_every_file_is_packaged():
    """A wheel holds a package's data files only where pyproject.toml's package-data has a pattern for them."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = setuptools.get("package-data", {})
    for path in asset_files():
        package = ".".join(path.parent.relative_to(ROOT).parts)
        assert package in setuptools["packages"], f"{path.relative_to(ROOT)}: {package} is not a listed package"
        patterns = [*data.get(package, []), *data.get("", [])]
        assert any(fnmatch(path.name, p) for p in patterns), \
            f"{path.relative_to(ROOT)}: add a pattern for it to [tool.setuptools.package-data] {package!r}"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed (it checks the JavaScript's syntax)")
def test_the_javascript_parses():
    """Each file as a module (a player's body awaits at its top level), and the players as the pages run them: a
    function of the page's root, made of player_unpack.js and the player's file."""
    from kvexplore.views import player, prefix_page

    scripts = {str(p.relative_to(ROOT)): (p.read_text(encoding="utf-8"), "module") for p in asset_files()
               if p.suffix == ".js"}
    for name, js in (("player", player.PLAYER), ("prefix page", prefix_page.PLAYER),
                     ("prefix comparison", prefix_page.LINK)):
        scripts[name] = (f"({js})(document.body);\n", "commonjs")
    for name, (js, kind) in scripts.items():
        done = subprocess.run(["node", "--check", f"--input-type={kind}"], input=js, capture_output=True, text=True,
                              timeout=60, check=False)
        assert done.returncode == 0, f"{name}:\n{done.stderr}"


def _text(node: ast.AST) -> str | None:
    """A string literal's text (an f-string's with ``{}`` for each value); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def inline_code(source: str) -> list[str]:
    """The string literals of ``source`` longer than :data:`LIMIT` lines that are JavaScript, HTML or CSS: they start
    as such code does, or most of their lines end as lines of code do."""
    found = []
    for node in walk(source):
        text = _text(node)
        if text is None:
            continue
        lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
        if len(lines) <= LIMIT:
            continue
        code = sum(l.endswith(ENDINGS) for l in lines) > len(lines) / 2
        if lines[0].startswith(STARTS) or code:
            found.append(f"line {node.lineno}: {lines[0][:60]!r} ({len(lines)} lines)")
    return found


def test_no_module_holds_javascript_html_or_css():
    held = {str(m.relative_to(ROOT)): inline_code(m.read_text(encoding="utf-8")) for m in modules()}
    held = {k: v for k, v in held.items() if v}
    assert not held, f"move these into .js/.html/.css files beside the module (kvexplore/views/assets.py): {held}"


def test_the_check_finds_code_put_back():
    """What the check above looks for, on the kinds of string that were moved out (and prose it leaves alone)."""
    js = "\n".join(f"  const x{i} = {i};" for i in range(20))
    css = "\n".join(f".kvx-{i} " + "{{font-size: {PX}px;}}" for i in range(20))  # as in an f-string
    cases = {
        "esm": f'_ESM = """\nexport default {{\n{js}\n}};\n"""',
        "style": f'STYLE = f"""<style>\n{css}\n</style>"""',
        "page": 'PAGE = """<div class="kvx-page" id="__ID__">\n' + "<p>x</p>\n" * 20 + '</div>"""',
        "body": f'PLAYER = "async function (root) {{" + r"""\n  try {{\n{js}\n  }} catch (e) {{}}\n}}"""',
        "script": f'_HIDE = """(function (copy) {{\n{js}\n}})(document.body);"""',
    }
    for name, source in cases.items():
        assert inline_code(source), name
    prose = '"""' + "\n".join(["A docstring of many lines, as a module's: what it is, and why."] * 30) + '"""'
    short = f'STYLE = """<style>\n{css[:200]}\n</style>"""'
    assert inline_code(prose) == [] and inline_code(short) == []
