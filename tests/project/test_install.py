"""The engine without the widgets: with the base requirements only (no notebook extra), ``import kvexplore``, a model,
a generator, the doctor and a prefix pool work, and the widgets, the HTML replay and ``kvexplore lab``/``app`` say
what to install (``pip install "kvexplore[notebook]"``). With the extra, the widgets import on first use as before.

Two ways: fast, this environment with the notebook extra's modules made unimportable (``sys.modules[name] = None``)
in a subprocess; slow (marker ``install``), a fresh virtual environment with torch and ``pip install -e .`` only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvexplore
from kvexplore.errors import NOTEBOOK_INSTALL, MissingExtraError, missing_extra

REPO = Path(__file__).resolve().parents[2]
WIDGETS = ("Explorer", "PrefixView", "PrefixCompare")
#: the notebook extra's modules that the fast test makes unimportable (a missing library behaves the same)
BLOCKED = ("anywidget", "ipywidgets", "plotly", "traitlets", "IPython", "jupyterlab", "voila")

#: run as ``python -c SCRIPT [modules to block]``: the engine's tour, then the widgets; prints one JSON object
SCRIPT = r"""
import json, sys, tempfile
for name in sys.argv[1:]:
    sys.modules[name] = None  # importing it now raises ModuleNotFoundError, as where it is not installed

import kvexplore
from kvexplore.cli import launch, main

launch._replace_process = lambda *args, **kwargs: 99  # never start JupyterLab or Voila here

out = {"all": kvexplore.__all__, "dir": dir(kvexplore)}
model = kvexplore.load("tiny")
gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=64))
gen.prefill("Call me Ishmael.")
out["tokens"] = [r.token_id for r in gen.run(4)]
out["doctor"] = type(kvexplore.doctor(model, steps=4)).__name__
pool = kvexplore.PrefixPool(model, num_blocks=16, block_size=8)
text = "Call me Ishmael. Some years ago, never mind how long precisely, having little money"
pool.serve(text, max_new_tokens=2)
out["pool"] = pool.serve(text, max_new_tokens=2).hit_tokens  # 16 of its 19 tokens: two blocks of 8
folder = tempfile.mkdtemp()
kvexplore.save_trace(gen.history, folder + "/a.kvtrace")
out["diff"] = type(kvexplore.diff_traces(kvexplore.load_trace(folder + "/a.kvtrace"), gen.history)).__name__
out["widgets"] = {}
for name in ("Explorer", "PrefixView", "PrefixCompare"):
    try:
        getattr(kvexplore, name)
        out["widgets"][name] = "imported"
    except kvexplore.MissingExtraError as e:
        out["widgets"][name] = [str(e), e.name, isinstance(e, ImportError)]
try:
    from kvexplore import Explorer
    out["from_import"] = "imported"
except ImportError as e:
    out["from_import"] = str(e)
exec("from kvexplore import *", {})  # the widgets are left out of __all__ where they cannot be imported
try:
    gen.history.save_html(folder + "/run.html")
    out["save_html"] = "written"
except kvexplore.MissingExtraError as e:
    out["save_html"] = str(e)
out["generate"] = main(["generate", "tiny", "--prompt", "hi", "--max-new-tokens", "3"])
out["lab"] = main(["lab", "--dir", folder + "/notebooks"])
out["app"] = main(["app"])
out["widget_modules"] = sorted(m for m in ("anywidget", "ipywidgets", "plotly") if sys.modules.get(m) is not None)
print("RESULT " + json.dumps(out))
"""


def run_script(python, *blocked: str, cwd=None) -> tuple[dict, str]:
    done = subprocess.run([str(python), "-c", SCRIPT, *blocked], capture_output=True, text=True, timeout=600,
                          cwd=cwd)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    assert done.returncode == 0 and line, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(line[len("RESULT "):]), done.stderr


def check_without_the_extra(out: dict, err: str) -> None:
    assert len(out["tokens"]) == 4 and out["doctor"] == "DoctorReport" and out["pool"] == 16
    assert out["diff"] == "TraceDiff"
    assert not set(WIDGETS) & (set(out["all"]) | set(out["dir"]))  # star imports and help() work without them
    assert {"load", "Generator", "doctor", "PrefixPool"} <= set(out["all"])
    for name, (message, module, is_import_error) in out["widgets"].items():
        assert message == (f"kvexplore.{name} needs {module}, which is not installed in this environment; install "
                           f'kvexplore\'s notebook extra: pip install "kvexplore[notebook]"')
        assert module in BLOCKED and is_import_error
    assert out["from_import"] == out["widgets"]["Explorer"][0]
    assert (out["save_html"].startswith("an HTML replay needs plotly, which is not installed")
            and NOTEBOOK_INSTALL in out["save_html"])
    assert out["generate"] == 0 and out["lab"] == 1 and out["app"] == 1 and out["widget_modules"] == []
    for command, what in (("lab", "JupyterLab"), ("app", "Voila")):
        assert (f"kvexplore {command}: error: {what} is not installed in this environment" in err
                and f"install the notebook extra: {NOTEBOOK_INSTALL}  (then run kvexplore {command} again)" in err)


def readme_commands() -> tuple[list[str], list[str]]:
    """The README's lines under "## Two commands" as .ci/run picks them: (main-job lines, test lines)."""
    text = (REPO / "README.md").read_text().split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("python3 -m venv ")]
    return ([l for l in lines if l.endswith(" && kvexplore lab")],
            [l for l in lines if re.search(r" && python -m pytest .*", l)])


def test_the_readme_holds_the_two_lines_ci_runs():
    """.ci/run reads the main-job line (run without its ``&& kvexplore lab``) and the test line from the README;
    the test line prints the 25 slowest tests, and docs/testing.md shows the same command."""
    (main,), (tests,) = readme_commands()
    assert main.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install torch==")
    assert " --upgrade pip" not in main + tests and 'pip install -e ".[notebook]"' in main
    assert tests.endswith(" --durations=25") and 'pip install -e ".[notebook,dev]"' in tests
    assert f"```bash\n{tests}\n```" in (REPO / "docs" / "testing.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "kvexplore lab" in ci and "README.md" in ci and "pip install" not in ci


@pytest.mark.long  # a subprocess that imports the package
def test_the_engine_works_with_the_widget_libraries_unimportable(tmp_path):
    out, err = run_script(sys.executable, *BLOCKED, cwd=tmp_path)
    check_without_the_extra(out, err)


@pytest.mark.long  # a subprocess that imports the package
def test_with_the_extra_the_widgets_load_on_first_use():
    done = subprocess.run([sys.executable, "-c", "import sys, kvexplore; "
                           "print(sorted(m for m in ('anywidget', 'ipywidgets', 'plotly') if m in sys.modules))"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"  # import kvexplore alone imports no widget library, extra or not
    from kvexplore import Explorer, PrefixCompare, PrefixView
    from kvexplore.explorer.prefix_compare import PrefixCompare as compare
    from kvexplore.explorer.prefix_widget import PrefixView as view
    from kvexplore.explorer.widget import Explorer as explorer

    assert (Explorer, PrefixView, PrefixCompare) == (explorer, view, compare)
    assert kvexplore.Explorer is explorer and kvexplore.explorer.Explorer is explorer
    assert set(WIDGETS) <= set(kvexplore.__all__) and set(WIDGETS) <= set(dir(kvexplore))
    with pytest.raises(AttributeError, match="module 'kvexplore' has no attribute 'Explorr'"):
        kvexplore.Explorr


def test_only_a_missing_notebook_module_becomes_the_install_hint():
    error = missing_extra("kvexplore.Explorer", ModuleNotFoundError("No module named 'plotly.offline'",
                                                                    name="plotly.offline"))
    assert isinstance(error, MissingExtraError) and isinstance(error, ImportError) and error.name == "plotly"
    assert str(error).endswith('pip install "kvexplore[notebook]"')
    assert missing_extra("kvexplore.Explorer", ModuleNotFoundError("No module named 'numpyy'", name="numpyy")) is None
    assert missing_extra("kvexplore.Explorer",
                         ImportError("cannot import name 'x' from 'plotly'", name="plotly")) is None


def _distributions(name: str, seen: dict | None = None) -> dict:
    """``name``'s installed distribution and those it requires (in this environment), by name."""
    import importlib.metadata as metadata

    from packaging.markers import Marker

    seen = {} if seen is None else seen
    dist = metadata.distribution(name)
    key = dist.metadata["Name"].lower()
    if key not in seen:
        seen[key] = dist
        for requirement in dist.requires or []:
            marker = requirement.split(";", 1)[1] if ";" in requirement else None
            if marker is None or Marker(marker).evaluate():
                _distributions(re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0], seen)
    return seen


def site_packages(venv: Path) -> Path:
    (site,) = (venv / "lib").glob("python3*/site-packages")
    return site


def share_torch(venv: Path) -> list[str]:
    """Make this environment's torch and the distributions it requires (nothing else) importable in ``venv``: a
    folder of links to them, on the venv's path through a ``.pth`` file. pip then sees torch installed, as after the
    README's ``pip install torch==2.13.0``, without copying its 700 MB again (a minute of the suite's time)."""
    shared = venv / "torch-shared"
    shared.mkdir()
    names = []
    for key, dist in _distributions("torch").items():
        if key in ("setuptools", "pip"):  # the venv has its own
            continue
        for top in sorted({Path(str(f)).parts[0] for f in dist.files or ()} - {"..", "__pycache__"}):
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (shared / top).exists():
                (shared / top).symlink_to(source)
                names.append(top)
    (site_packages(venv) / "torch-shared.pth").write_text(str(shared) + "\n")
    return names


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory):
    """A fresh virtual environment with the base requirements only: the pip ``python3 -m venv`` ships, torch 2.13.0
    first (as the README says: this environment's, shared by :func:`share_torch`, with only what torch requires),
    then ``pip install -e <repo>`` (no extra)."""
    import torch

    venv = tmp_path_factory.mktemp("base") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    assert torch.__version__.startswith("2.13.0") and "anywidget" not in " ".join(share_torch(venv))
    python = str(venv / "bin" / "python")
    found = subprocess.run([python, "-m", "pip", "show", "torch"], capture_output=True, text=True)
    assert "Version: 2.13.0" in found.stdout, found.stdout + found.stderr  # pip sees it installed
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-compile", "-e", str(REPO)],
                          capture_output=True, text=True, timeout=900)  # no .pyc: a third faster
    assert done.returncode == 0, f"pip install -e failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert not (site_packages(venv) / "torch").exists()  # pip kept the shared torch (it did not install another)
    return venv


@pytest.mark.install
def test_the_engine_works_in_a_fresh_venv_without_the_notebook_extra(base_venv, tmp_path):
    python = base_venv / "bin" / "python"
    absent = subprocess.run([str(python), "-c", "import importlib.util as u; print([m for m in ('anywidget', "
                             "'ipywidgets', 'plotly', 'jupyterlab') if u.find_spec(m)])"],
                            capture_output=True, text=True, check=True)
    assert absent.stdout.strip() == "[]", "the base install pulled in a notebook library"
    out, err = run_script(python, cwd=tmp_path)
    check_without_the_extra(out, err)
    console = subprocess.run([str(base_venv / "bin" / "kvexplore"), "generate", "tiny", "--prompt", "hi",
                              "--max-new-tokens", "3"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert console.returncode == 0 and "tokens in" in console.stdout + console.stderr
