"""Real-browser test support, the processes: JupyterLab and Voila on loopback, and the Debian Chromium that
Playwright for Python drives (the pages themselves are driven by ``browser_pages.py``; ``browser_support.py`` gives
both under one name).

Everything here is isolated and offline: fresh ``JUPYTER_*`` / ``IPYTHONDIR`` folders, a temporary copy of the
notebooks (JupyterLab's autosave would write outputs back), a random free port, a token, and a browser that may only
reach 127.0.0.1. Servers run in their own process group and are always killed, group and all. Waits are on
conditions (HTTP answers), never fixed sleeps.

Needs ``/usr/bin/chromium`` (``apt-get install chromium fonts-liberation``) and ``pip install playwright`` (never
``playwright install``: it downloads a browser). Without them the tests skip with a message saying so.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import importlib.util
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from pathlib import Path

import pytest

NOTEBOOKS = Path(os.environ.get("KVX_NOTEBOOKS") or Path(__file__).resolve().parents[2] / "notebooks")  # served
CHROMIUM = Path(os.environ.get("KVX_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
LOCAL = ("http://127.0.0.1", "ws://127.0.0.1", "data:", "blob:", "about:")
SERVER_START_S = 90


def require_browser(*modules: str) -> None:
    """Skip the calling test, with the reason and the fix, when the browser stack is missing."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium fonts-liberation (.ci/run does this)")
    for module, fix in (("playwright", 'pip install -e ".[notebook,dev]" (never `playwright install`)'),
                        *((m, 'pip install -e ".[notebook,dev]"') for m in modules)):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: {fix}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(state: Path, inspect: bool = True) -> dict[str, str]:
    """The environment of a server that sees no user configuration and writes only under ``state``; with
    ``inspect`` its explorers keep their state in the page (``KVEXPLORE_INSPECT``, for browser_truth.py)."""
    env = dict(os.environ)
    for name in ("JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR", "JUPYTER_RUNTIME_DIR", "IPYTHONDIR"):
        env[name] = str(state / name.lower())
        Path(env[name]).mkdir(parents=True, exist_ok=True)
    env.pop("JUPYTER_PATH", None)
    env.pop("JUPYTER_CONFIG_PATH", None)
    env["JUPYTER_PLATFORM_DIRS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    if inspect:
        env["KVEXPLORE_INSPECT"] = "1"
    else:
        env.pop("KVEXPLORE_INSPECT", None)
    # the "receive Jupyter news?" announcements plugin: a popup that covers elements, and a network call
    labconfig = state / "jupyter_config_dir" / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    return env


class Server:
    """A server process in its own process group, its output in a log file; ``url`` answers when it is up."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path, base_url: str, token: str = ""):
        self.argv, self.base_url, self.token, self.log_path = argv, base_url, token, log
        self.log = open(log, "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, path: str, timeout: float = SERVER_START_S, any_status: bool = False) -> float:
        """Wait until GET ``path`` answers 200 (any HTTP status with ``any_status``); returns the seconds it took."""
        t0 = time.monotonic()
        url = self.base_url + path
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {' '.join(self.argv)}\n{self.output()}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except urllib.error.HTTPError:
                if any_status:
                    return time.monotonic() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"server not answering {url} after {timeout} s\n{self.output()}")
            time.sleep(0.2)  # polling interval of a condition wait, not a fixed delay

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """Terminate the whole process group (the server and its kernels); kill it if it lingers."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # kernels left in the group
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self.log.close()


@contextlib.contextmanager
def lab_server(notebooks: Path, workdir: Path, inspect: bool = True) -> Iterator[Server]:
    """JupyterLab serving a temporary copy of ``notebooks``; yields the running server (``.root`` is the copy).
    ``inspect`` as in :func:`isolated_env`."""
    root = workdir / "root"
    shutil.copytree(notebooks, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "*.pyc", "__pycache__"))
    state = workdir / "state"
    env = isolated_env(state, inspect)
    port, token = free_port(), secrets.token_hex(16)
    argv = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
            f"--IdentityProvider.token={token}", "--allow-root", f"--ServerApp.root_dir={root}",
            "--ServerApp.port_retries=0", "--LabApp.extension_manager=readonly", "--LabApp.news_url=None",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            f"--LabApp.workspaces_dir={state / 'workspaces'}", "--LabApp.expose_app_in_browser=True"]
    server = Server(argv, env, root, workdir / "lab.log", f"http://127.0.0.1:{port}", token)
    server.root = root
    try:
        server.ready_s = server.wait_ready(f"/api/status?token={token}")
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def voila_server(workdir: Path, model: str = "tiny", strategies: tuple[str, ...] | None = None,
                 inspect: bool = True, **app: Any) -> Iterator[Server]:
    """``kvexplore app``'s Voila command (the same argv and environment), on a free loopback port; ``app`` may give
    :func:`~kvexplore.cli.launch.app_environment`'s ``prompt`` and ``max_seq_len`` (by default the app's)."""
    from kvexplore.cli import launch

    state = workdir / "state"
    env = launch.app_environment(model, strategies, base=isolated_env(state, inspect), **app)  # prefilled
    port = free_port()
    with importlib.resources.as_file(launch.app_notebook()) as notebook:
        argv = launch.app_command(notebook, port=port, no_browser=True)
        server = Server(argv, env, workdir, workdir / "voila.log", f"http://127.0.0.1:{port}")
        try:
            # a 404 from Voila's static handler means it is up, and starts no kernel (GET / runs the notebook)
            server.ready_s = server.wait_ready("/voila/static/kvx-readiness-probe", any_status=True)
            yield server
        finally:
            server.stop()


@contextlib.contextmanager
def chromium(viewport: dict | None = None) -> Iterator[object]:
    """A Playwright browser context on Debian Chromium with a fresh profile, able to reach only 127.0.0.1.

    ``context.console_errors`` collects the pages' console errors (for the report, not for asserting);
    ``context.external_requests`` every URL a page asked for outside 127.0.0.1 (refused).
    """
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p, tempfile.TemporaryDirectory(prefix="kvx-chromium-") as profile:
        ctx = p.chromium.launch_persistent_context(profile, executable_path=str(CHROMIUM), headless=True,
                                                   args=CHROMIUM_ARGS,
                                                   viewport=viewport or {"width": 1400, "height": 1000})
        ctx.console_errors = []
        ctx.external_requests = []  # every request that would have left 127.0.0.1 (aborted): tests assert none

        def route(r):
            if r.request.url.startswith(LOCAL):
                r.continue_()
            else:
                ctx.external_requests.append(r.request.url)
                r.abort()

        ctx.route("**/*", route)
        ctx.set_default_timeout(60_000)
        try:
            yield ctx
        finally:
            ctx.close()
