"""``kvexplore lab`` and ``kvexplore app``: open the bundled notebooks in JupyterLab, or serve the explorer with Voila.

``lab`` copies the bundled notebooks (``kvexplore.notebooks``) missing from a writable folder (default
``~/kvexplore-notebooks``; a file already there is never overwritten), then replaces itself with ``python -m
jupyterlab`` on that folder, run by this same interpreter. ``app`` serves ``kvexplore/explorer/app.ipynb`` with Voila,
passing its settings in the environment (:mod:`kvexplore.explorer.app_page` reads them), drawn with kvexplore's own
Voila template, which makes no request beyond 127.0.0.1 (:func:`app_jupyter_data`; docs/cli.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from urllib.parse import urlencode
from pathlib import Path
from collections.abc import Iterable, Sequence

try:
    from importlib.resources.abc import Traversable
except ImportError:  # Python 3.10
    from importlib.abc import Traversable

from ..errors import NOTEBOOK_INSTALL, KVExploreError
from ..explorer import app_page

DEFAULT_DIR = Path("~") / "kvexplore-notebooks"
INSTALL_HINT = NOTEBOOK_INSTALL  # works next to an editable install from a checkout too (pip keeps it, adds the extra)
#: what the notebooks and the explorer page import, besides JupyterLab or Voila: (module, name to show)
WIDGET_LIBRARIES = (("ipywidgets", "ipywidgets"), ("plotly", "plotly"), ("anywidget", "anywidget"))
APP_MODEL_ENV, APP_STRATEGIES_ENV, APP_PROMPT_ENV, APP_MAX_SEQ_LEN_ENV = (
    app_page.MODEL_ENV, app_page.STRATEGIES_ENV, app_page.PROMPT_ENV, app_page.MAX_SEQ_LEN_ENV)
APP_PROMPT, APP_MAX_SEQ_LEN = app_page.PROMPT, app_page.MAX_SEQ_LEN
APP_TEMPLATE = "kvexplore"  # the template's name for Voila (--template=kvexplore)
#: the template's files, in kvexplore/explorer/voila_template/ (Voila's template folder: its config, its page)
APP_TEMPLATE_FILES = ("conf.json", "index.html.j2")


class LaunchError(KVExploreError):
    """JupyterLab or Voila is missing, or the bundled notebooks cannot be found."""


@dataclass
class CopyReport:
    """What :func:`copy_notebooks` did: names copied into ``folder`` and names already there (kept as they were)."""

    folder: Path
    copied: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"notebooks folder: {self.folder}"]
        if self.copied:
            lines.append(f"  copied: {', '.join(self.copied)}")
        if self.kept:
            lines.append(f"  kept as they are (yours, not overwritten): {', '.join(self.kept)}")
        if not self.copied and not self.kept:
            lines.append("  (no bundled notebooks found)")
        return "\n".join(lines)


def notebooks_root() -> Traversable:
    """The folder of bundled notebooks: the ``kvexplore.notebooks`` resources (a wheel install), else the source
    checkout's ``notebooks/`` (an editable install maps that package to it)."""
    try:
        root = resources.files("kvexplore.notebooks")
        if root.is_dir() and any(p.name.endswith(".ipynb") for p in root.iterdir()):
            return root
    except (ModuleNotFoundError, TypeError, OSError):
        pass
    inside = resources.files("kvexplore").joinpath("notebooks")
    if inside.is_dir():
        return inside
    here = Path(__file__).resolve().parent.parent  # the package folder, in a source checkout beside pyproject.toml
    if (here.parent / "notebooks").is_dir() and (here.parent / "pyproject.toml").is_file():
        return here.parent / "notebooks"
    raise LaunchError("the bundled notebooks (package kvexplore.notebooks) are missing from this installation; "
                      "reinstall kvexplore: pip install .")


def bundled_notebooks(root: Traversable | None = None) -> list[Traversable]:
    """The bundled ``*.ipynb`` files, in name order (the course order: 01_..., 02_...)."""
    root = notebooks_root() if root is None else root
    return sorted((p for p in root.iterdir() if p.name.endswith(".ipynb") and p.is_file()), key=lambda p: p.name)


def bundled_course(root: Traversable | None = None) -> list[Traversable]:
    """The bundled notebooks, then the course's ``README.md`` (the list every notebook's "Where next" links to)."""
    root = notebooks_root() if root is None else root
    guide = root.joinpath("README.md")
    return bundled_notebooks(root) + ([guide] if guide.is_file() else [])


def _write_new(target: Path, data: bytes) -> bool:
    """Write ``data`` to ``target`` only if ``target`` does not exist; never a half-written notebook in its place."""
    tmp = target.with_name(f".{target.name}.kvexplore-tmp-{os.getpid()}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, target)  # atomic, and fails if target appeared meanwhile
        return True
    except FileExistsError:
        return False
    except OSError:  # a filesystem without hard links
        try:
            with open(target, "xb") as f:
                f.write(data)
            return True
        except FileExistsError:
            return False
    finally:
        tmp.unlink(missing_ok=True)


def copy_notebooks(folder: str | os.PathLike[str], sources: Iterable[Traversable] | None = None) -> CopyReport:
    """Copy each bundled notebook (default: and the course's README) missing from ``folder`` into it (creating
    it); keep every file already there."""
    folder = Path(folder).expanduser()
    sources = bundled_course() if sources is None else sorted(sources, key=lambda p: p.name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LaunchError(f"cannot create the notebooks folder {folder}: {e.strerror or e}; "
                          f"choose another with --dir") from e
    report = CopyReport(folder.resolve())
    for src in sources:
        target = folder / src.name
        if target.exists() or not _write_new(target, src.read_bytes()):
            report.kept.append(src.name)
        else:
            report.copied.append(src.name)
    return report


def _require(command: str, *modules: tuple[str, str]) -> None:
    """Refuse to start when one of ``modules`` ((module, name to show), the first missing is named) is not installed."""
    for module, what in modules:
        if importlib.util.find_spec(module) is None:
            raise LaunchError(f"{what} is not installed in this environment ({sys.executable}); "
                              f"install the notebook extra: {INSTALL_HINT}  (then run kvexplore {command} again)")


def lab_command(folder: str | os.PathLike[str], port: int | None = None, no_browser: bool = False,
                extra: Sequence[str] = ()) -> list[str]:
    """The ``python -m jupyterlab`` command line serving ``folder``."""
    argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={Path(folder).expanduser().resolve()}"]
    if port is not None:
        argv.append(f"--port={port}")
    if no_browser:
        argv.append("--no-browser")
    if _is_root() and "--allow-root" not in extra:  # containers and CI machines: JupyterLab refuses root otherwise
        argv.append("--allow-root")
    return argv + list(extra)


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def app_notebook() -> Traversable:
    """The Voila page: ``kvexplore/explorer/app.ipynb`` inside the installed package."""
    nb = resources.files("kvexplore").joinpath("explorer", "app.ipynb")
    if not nb.is_file():
        raise LaunchError("kvexplore/explorer/app.ipynb is missing from this installation; reinstall kvexplore")
    return nb


def app_template() -> Traversable:
    """kvexplore's Voila template inside the installed package: ``kvexplore/explorer/voila_template/``, holding
    :data:`APP_TEMPLATE_FILES`."""
    template = resources.files("kvexplore").joinpath("explorer", "voila_template")
    if missing := [name for name in APP_TEMPLATE_FILES if not template.joinpath(name).is_file()]:
        raise LaunchError(f"kvexplore's Voila template (kvexplore/explorer/voila_template/) is missing "
                          f"{', '.join(missing)} in this installation; reinstall kvexplore: pip install .")
    return template


_jupyter_data: Path | None = None  # this process's data folder (app_jupyter_data)


def app_jupyter_data() -> Path:
    """A Jupyter data folder where Voila finds kvexplore's template (``<it>/voila/templates/kvexplore/``, a copy of
    :func:`app_template`'s files): made once per process in a new temporary folder, which is left for the system
    to clear (Voila, which replaces this process, reads the template for as long as it serves)."""
    global _jupyter_data
    template = app_template()
    if _jupyter_data is None or not (_jupyter_data / "voila" / "templates" / APP_TEMPLATE).is_dir():
        data = Path(tempfile.mkdtemp(prefix="kvexplore-voila-"))
        folder = data / "voila" / "templates" / APP_TEMPLATE
        folder.mkdir(parents=True)
        for name in APP_TEMPLATE_FILES:
            (folder / name).write_bytes(template.joinpath(name).read_bytes())
        _jupyter_data = data
    return _jupyter_data


def app_command(notebook: str | os.PathLike[str], port: int | None = None, no_browser: bool = True,
                extra: Sequence[str] = ()) -> list[str]:
    """The ``python -m voila`` command line serving the explorer notebook on loopback, with kvexplore's template
    (which Voila finds through the ``JUPYTER_PATH`` of :func:`app_environment`)."""
    argv = [sys.executable, "-m", "voila", str(notebook), "--Voila.ip=127.0.0.1", f"--template={APP_TEMPLATE}",
            "--VoilaConfiguration.progressive_rendering=True"]  # the page shows before the first prompt's prefill
    if no_browser:
        argv.append("--no-browser")
    if port is not None:
        argv.append(f"--port={port}")
    return argv + list(extra)


def app_environment(model: str, strategies: Sequence[str] | None, prompt: str = APP_PROMPT,
                    base: dict[str, str] | None = None, max_seq_len: int = APP_MAX_SEQ_LEN,
                    options: dict[str, dict] | None = None) -> dict[str, str]:
    """The environment for Voila and its kernel: the model, strategies, caches' size and prompt the app notebook
    reads, and ``JUPYTER_PATH`` led by :func:`app_jupyter_data` (set or not before, its other entries kept after
    it), where Voila finds the template of :func:`app_command`."""
    env = dict(os.environ if base is None else base)
    data = str(app_jupyter_data())
    others = [p for p in env.get("JUPYTER_PATH", "").split(os.pathsep) if p and p.rstrip(os.sep) != data]
    env["JUPYTER_PATH"] = os.pathsep.join([data, *others])
    env[APP_MODEL_ENV] = model
    env[APP_PROMPT_ENV] = prompt
    env[APP_MAX_SEQ_LEN_ENV] = str(max_seq_len)
    for name, value in ((app_page.OPTIONS_ENV, json.dumps(options) if options else ""),
                        (APP_STRATEGIES_ENV, ",".join(strategies) if strategies else "")):
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    return env


def _replace_process(argv: list[str], env: dict[str, str] | None = None) -> int:
    """Become ``argv`` (POSIX exec); elsewhere run it and return its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.name == "posix":
        os.execve(argv[0], argv, os.environ if env is None else env)
    return subprocess.call(argv, env=env)


def lab(folder: str | os.PathLike[str] | None = None, port: int | None = None, no_browser: bool = False,
        extra: Sequence[str] = ()) -> int:
    """``kvexplore lab``: copy the missing notebooks into ``folder``, say what was copied and kept, start JupyterLab."""
    _require("lab", ("jupyterlab", "JupyterLab"), *WIDGET_LIBRARIES)
    report = copy_notebooks(DEFAULT_DIR if folder is None else folder)
    print(report.summary(), flush=True)
    return _replace_process(lab_command(report.folder, port=port, no_browser=no_browser, extra=extra))


def app(model: str = "tiny", strategies: Sequence[str] | None = None, port: int | None = None,
        no_browser: bool = True, extra: Sequence[str] = (), prompt: str = APP_PROMPT,
        max_seq_len: int = APP_MAX_SEQ_LEN, options: dict[str, dict] | None = None) -> int:
    """``kvexplore app``: serve the explorer as a standalone page with Voila (code cells hidden); ``options``: lane ->
    its cache's options (``--strategy-option``)."""
    _require("app", ("voila", "Voila"), *WIDGET_LIBRARIES)
    first = {"model": model, "strategies": ",".join(strategies or app_page.STRATEGIES), "max_seq_len": max_seq_len,
             "prompt": prompt}
    print(f"a link to the first view: http://127.0.0.1:{port or 8866}/?{urlencode(first)} (the page's \"link to "
          f"this view\" button writes the link of what it shows; steps, lane, layer, head and tab follow it)",
          flush=True)
    with resources.as_file(app_notebook()) as nb:
        return _replace_process(app_command(nb, port=port, no_browser=no_browser, extra=extra),
                                env=app_environment(model, strategies, prompt, max_seq_len=max_seq_len,
                                                    options=options))
