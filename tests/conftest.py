"""What the whole suite shares: one model zoo (tests/zoo.py), the tiers (markers) and the groups that keep servers,
kernels and compiled graphs shared when the suite runs in two workers (``pytest -n 2``, see docs/testing.md).

Tiers, by what a test needs (``slow`` is their union; the fast tier is ``-m "not slow"``):

- ``browser``: headless Chromium with JupyterLab, Voila or a replay page;
- ``notebooks``: the course notebooks executed in a kernel;
- ``smollm2``: the real SmolLM2-135M (a 93 MB download the first time);
- ``gemma3``: the real Gemma 3 270M (about 240 MB the first time, then transformers' reference once);
- ``compile``: torch.compile of a model (inductor's C++ code, tens of seconds the first time).

Groups (``xdist_group``): the tests that share the JupyterLab server (``lab``) or the compiled step of one model
(``compile``) run in the same worker, so nothing is started or compiled twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from zoo import VARIANTS, Zoo

# the test models are tiny: one thread is fastest, and immune to other processes contending for cores (two workers)
torch.set_num_threads(1)

TIERS = ("browser", "notebooks", "smollm2", "gemma3", "compile")


def pytest_configure(config):
    # pytest-xdist (3.8) keeps a group in one worker by renaming its tests' node ids, which pytest 9.2 ignores: the
    # servers and compiled steps would then be built in both workers. Refuse at once, naming the fix.
    from _pytest.nodes import Node

    if config.getoption("dist", "no") == "loadgroup" and "_nodeid" not in Node.nodeid.fget.__code__.co_names:
        raise pytest.UsageError(f"pytest-xdist cannot keep --dist loadgroup's groups in one worker with pytest "
                                f"{pytest.__version__}: pip install -e '.[dev]' installs a pytest that it can")
    # one inductor cache for the run and its subprocesses and kernels (inherited through the environment), kept in
    # pytest's cache folder so that a second run reuses the compiled kernels too; a cache set by the caller wins
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ and getattr(config, "cache", None) is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(config.cache.mkdir("inductor"))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # in a worker, the kernels, servers and subprocesses it starts compute on one thread too: two workers already
        # keep both cores busy, and a second thread each would only contend with the other worker
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.slow)
    # the notebooks' runs first among the tests that are not in a group, and the browser tests that open executed
    # notebooks last, in reverse order: the JupyterLab worker executes the last notebooks itself while the other
    # worker executes the first ones, and neither waits for the other (each notebook still runs once)
    position = {id(item): i for i, item in enumerate(items)}

    def order(item) -> tuple[int, int]:
        browser, notebooks = item.get_closest_marker("browser"), item.get_closest_marker("notebooks")
        if browser and notebooks:
            return 2, -position[id(item)]
        return (0 if notebooks else 1), position[id(item)]

    items.sort(key=order)


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> Zoo:
    return Zoo(tmp_path_factory)


@pytest.fixture(scope="session")
def checkpoint(zoo):
    """``checkpoint(name) -> (folder, transformers reference model)`` for a name of :data:`VARIANTS`."""
    return zoo.variant


@pytest.fixture(scope="session")
def tiny(zoo):
    """The default small model for cache and generator tests (random weights, Llama with two KV heads)."""
    arch, options = VARIANTS["llama-gqa2"]
    return zoo.load(arch, **options)


@pytest.fixture(scope="session")
def trained(zoo):
    """The packaged ``tiny`` model, trained weights (greedy text that reads like text)."""
    return zoo.trained


# --- shared browser, servers and executed notebooks --------------------------------------------------------------

def _run_root(tmp_path_factory) -> Path:
    """The folder shared by this run's workers (each xdist worker's base temp is inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def shots(tmp_path_factory) -> Path:
    """Where the browser tests put their screenshots: ``$KVX_SCREENSHOTS``, or a temporary folder."""
    folder = Path(os.environ.get("KVX_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="session")
def chromium_session():
    """One headless Chromium for the run (per worker); pages and contexts come and go inside it."""
    from browser_support import chromium, require_browser

    require_browser()
    with chromium() as ctx:
        yield ctx
    if ctx.console_errors:
        print("\nbrowser console errors:\n  " + "\n  ".join(dict.fromkeys(ctx.console_errors)))


@pytest.fixture
def browser(chromium_session):
    """The run's Chromium for one test, which fails if a page of the test asked for anything outside 127.0.0.1."""
    start = len(chromium_session.external_requests)
    yield chromium_session
    outside = chromium_session.external_requests[start:]
    assert outside == [], f"pages asked for resources outside 127.0.0.1: {outside}"


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """One JupyterLab server for the run (per worker), serving a temporary copy of notebooks/; tests add their own
    notebooks to ``lab.root``."""
    from browser_support import NOTEBOOKS, lab_server, require_browser

    require_browser("jupyterlab", "ipywidgets", "plotly", "anywidget")
    with lab_server(NOTEBOOKS, tmp_path_factory.mktemp("lab")) as server:
        yield server


@pytest.fixture(scope="session")
def lab_page(lab, chromium_session):
    """One JupyterLab page for the run: ``with lab_page.notebook(name) as page:`` (see browser_support.LabPage)."""
    from browser_support import LabPage

    page = LabPage(lab, chromium_session)
    yield page
    if page.page is not None and not page.page.is_closed():
        page.page.close()


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """``executed_notebook(path) -> (executed copy's path, {"seconds", "error"})``: each notebook runs top to bottom
    in a fresh kernel once per run, whichever worker asks first (a file lock per notebook); the tests that look at
    it (its run, its rendering in JupyterLab, its export) share the copy."""
    import json
    import time

    from filelock import FileLock

    shared = _run_root(tmp_path_factory) / "executed-notebooks"
    shared.mkdir(exist_ok=True)

    def get(path: Path) -> tuple[Path, dict]:
        nbformat = pytest.importorskip("nbformat", reason="pip install -e '.[notebook,dev]'")
        nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[notebook,dev]'")
        out, meta = shared / path.name, shared / f"{path.stem}.json"
        if "gemma3-270m" in path.read_text():  # fetched here once, or skipped saying why: no kernel waits on it
            from gemma3_support import require_gemma3

            require_gemma3()
        with FileLock(str(shared / f"{path.stem}.lock")):
            if not meta.exists():
                workdir = shared / path.stem
                workdir.mkdir(exist_ok=True)
                nb = nbformat.read(path, as_version=4)
                client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                                 resources={"metadata": {"path": str(workdir)}})
                t0, error = time.monotonic(), None
                try:
                    client.execute()
                except Exception as e:  # the failing cell's traceback, reported by the test that asks
                    error = f"{type(e).__name__}: {e}"
                nbformat.write(nb, str(out))
                meta.write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1), "error": error}))
        return out, json.loads(meta.read_text())

    return get
