"""What the whole suite shares: one model zoo (tests/support/zoo.py), the tiers (markers) and the groups that keep
servers, kernels and compiled graphs shared when the suite runs in workers (``pytest -n 3``, see docs/testing.md).

Tiers, by what a test needs (``slow`` is their union; the fast tier is ``-m "not slow"``):

- ``browser``: headless Chromium with JupyterLab, Voila or a replay page;
- ``notebooks``: the course notebooks executed in a kernel;
- ``smollm2``: the real SmolLM2-135M (a 93 MB download the first time);
- ``gemma3``: the real Gemma 3 270M (about 240 MB the first time, then transformers' reference once);
- ``compile``: torch.compile of a model (inductor's C++ code, tens of seconds the first time);
- ``install``: a fresh virtual environment built with pip (the package without its notebook extra);
- ``long``: a test on the tiny models that runs for seconds (hundreds of steps against a recomputation, a whole
  matrix of architectures and caches, subprocesses that import the package, a sampled distribution): the tests marked
  ``@pytest.mark.long`` where they are written (a comment beside the mark says what makes each long), and two cases
  of every three of each matrix marked ``@pytest.mark.sampled`` (the fast tier runs the first case of every three,
  in collection order: :data:`SAMPLE_EVERY`). Each has quicker neighbours in the fast tier that check the same code
  on fewer cases.

Only the ``smollm2`` and ``gemma3`` tests may fetch or load a real named model: any other test that starts a model
download, or loads smollm2-135m or gemma3-270m from a populated ``$KVEXPLORE_HOME``, fails saying so (the autouse
fixture ``_real_models_only_in_their_tiers``), and the fast tier's subprocesses run with ``PIP_NO_INDEX=1``. So the
fast tier runs on a machine that has never fetched a model, as a stranger's does.

Groups (``xdist_group``): the tests that share a JupyterLab server (``lab``: the page truth and layout tests;
``lab-course``: the course's notebooks, with a server of their own so that the two groups run side by side), the
compiled step of one model (``compile``) or Gemma 3's transformers reference (``gemma3``) run in the same worker, so
nothing is started or compiled twice and no worker waits on a file lock for what the other computes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from zoo import VARIANTS, Zoo

# the test models are tiny: one thread is fastest, and immune to other processes contending for cores (the workers)
torch.set_num_threads(1)

TIERS = ("browser", "notebooks", "smollm2", "gemma3", "compile", "install", "long")
# of a function marked ``sampled`` (a matrix of cases), the fast tier runs every SAMPLE_EVERY-th case, in collection
# order, and the ``long`` tier the rest (the full suite runs all of them)
SAMPLE_EVERY = 3
REAL_MODELS = {"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}  # named model -> the marker of its tier


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
    # the suite starts dozens of Python processes (workers, kernels, servers, subprocesses): let the first that imports
    # kvexplore and the tests write their bytecode, so that the others do not compile them again (a machine-wide
    # PYTHONDONTWRITEBYTECODE=1 costs each of them about a second)
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
        sys.dont_write_bytecode = False
    # the products on F.linear, in the workers and every process they start, where a lane or a generator turns the
    # product kernels on: a busy worker's timing would choose differently from run to run, and building them costs
    # each process seconds (importing inductor, 13 s for the first kernel from a fresh clone, then a second or more
    # each of the 30-odd kernels a run asks for). tests/engine/test_products.py forces them on and checks their
    # products, their choice and their use in a step and a drafting generator; tests/engine/test_parity.py a model's
    # logits with them.
    os.environ.setdefault("KVEXPLORE_PRODUCTS", "torch")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # in a worker, the kernels, servers and subprocesses it starts compute on one thread too: the workers already
        # keep both cores busy, and a second thread each would only contend with the other worker
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def _notebook_path(item) -> Path | None:
    """The course notebook a test is parametrized with (``path``), if any."""
    path = getattr(getattr(item, "callspec", None), "params", {}).get("path")
    return path if isinstance(path, Path) and path.suffix == ".ipynb" and path.exists() else None


def _notebook_models(item) -> list[str]:
    """The tiers of the real models a notebook loads, for a test parametrized with that notebook (``path``): its
    execution is shared (``executed_notebook``), so whichever test runs it first fetches them."""
    path = _notebook_path(item)
    if path is None:
        return []
    text = path.read_text()
    return [tier for name, tier in (("smollm2", "smollm2"), ("gemma3-270m", "gemma3")) if name in text]


def pytest_collection_modifyitems(config, items):
    cases: dict[tuple[str, str], int] = {}  # each sampled function's cases seen so far
    for item in items:
        if item.get_closest_marker("sampled"):
            function = (str(item.path), getattr(item, "originalname", item.name))
            cases[function] = cases.get(function, -1) + 1
            if cases[function] % SAMPLE_EVERY:
                item.add_marker(pytest.mark.long)
        for tier in _notebook_models(item):
            if not item.get_closest_marker(tier):
                item.add_marker(getattr(pytest.mark, tier))
        if any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.slow)
    # the notebooks' runs first among the tests that are not in a group (the other worker executes them from the
    # first on); the JupyterLab worker begins by opening the last third of the course, last first, executing those
    # notebooks itself, and opens the others at its end, by when they have been executed: neither worker waits for a
    # notebook the other is executing (each notebook still runs once)
    position = {id(item): i for i, item in enumerate(items)}
    course = sorted({p for item in items if (p := _notebook_path(item)) is not None})
    tail = set(course[len(course) - len(course) // 3:])

    # then, of the rest, the browser and install tests first (each starts servers, a browser page or a virtual
    # environment: tens of seconds, up to a minute or more), the many short tests after them: the workers' last
    # tests are short ones, and none ends the run alone while the others wait (the Voila tests came last, in
    # collection order)
    def order(item) -> tuple[int, int]:
        browser, notebooks = item.get_closest_marker("browser"), item.get_closest_marker("notebooks")
        if browser and notebooks:
            return (1 if _notebook_path(item) in tail else 4), -position[id(item)]
        if notebooks:
            return 0, position[id(item)]
        heavy = (browser or item.get_closest_marker("install")) and "executed_notebook" not in item.fixturenames
        return (2 if heavy else 3), position[id(item)]

    items.sort(key=order)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The machine's pace beside the run's times: these machines are shared and their speed drifts by a third within
    an hour, so a wall time means little alone. One torch thread, the packaged tiny model, 100 decode steps on a
    pre-allocated cache (the suite's typical work), the best of three; compare runs by this figure too
    (docs/testing.md lists runs with theirs)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or config.getoption("collectonly"):
        return
    import time

    import kvexplore

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = kvexplore.load("tiny")
        best = float("inf")
        for _ in range(3):
            gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=256))
            gen.prefill("Call me Ishmael.")
            t0 = time.perf_counter()
            gen.run(100, stop_at_eos=False)
            best = min(best, (time.perf_counter() - t0) / 100)
    finally:
        torch.set_num_threads(threads)
    terminalreporter.write_line(f"machine pace: {best * 1e3:.2f} ms per decode step of the packaged tiny model (one "
                                f"thread, best of 3 x 100 steps): compare wall times of runs at the same pace")


_PYTHON = sys.executable  # the real interpreter: a test that swaps it in kvexplore's store runs a fake pip


@pytest.fixture(autouse=True)
def _real_models_only_in_their_tiers(request, monkeypatch):
    """A test not marked ``smollm2`` or ``gemma3`` neither downloads a named model nor loads a real one: it fails at
    once, naming the marker it needs (also where the model is already in ``$KVEXPLORE_HOME``, as it is on the machines
    of those who wrote the test). Fakes pass: a test's own ``download_command`` or pip, and the models a test adds to
    the store. In the fast tier, the subprocesses a test starts cannot download either (``PIP_NO_INDEX=1``)."""
    allowed = {name for name, tier in REAL_MODELS.items() if request.node.get_closest_marker(tier)}
    if len(allowed) == len(REAL_MODELS):
        return
    from kvexplore.formats import loading, store

    def refuse(name: str, what: str):
        pytest.fail(f"{request.node.nodeid} {what} {name}, which only a test marked {REAL_MODELS[name]} may do: "
                    f"mark it @pytest.mark.{REAL_MODELS[name]} (the slow tier), or use the tiny model or the zoo "
                    f"(tests/support/zoo.py). The fast tier runs where no model was ever fetched.", pytrace=False)

    real = {name: store.MODELS[name] for name in REAL_MODELS}
    download, fetch, command = store._download, store.fetch, store.download_command

    def guarded_download(spec, progress):
        faked = store.download_command is not command or store.sys.executable != _PYTHON
        if not faked and spec.name not in allowed and real.get(spec.name) == spec:
            refuse(spec.name, "started downloading")
        return download(spec, progress)

    def guarded_fetch(name, *args, **kwargs):
        folder = fetch(name, *args, **kwargs)
        if name in real and name not in allowed and store.MODELS.get(name) == real[name]:
            refuse(name, "loaded")
        return folder

    monkeypatch.setattr(store, "_download", guarded_download)
    monkeypatch.setattr(store, "fetch", guarded_fetch)
    monkeypatch.setattr(loading, "fetch", guarded_fetch, raising=False)  # kvexplore.load's own name for it
    if not request.node.get_closest_marker("slow"):
        monkeypatch.setenv("PIP_NO_INDEX", "1")


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
                try:  # the kernel's products on F.linear, as every process the suite starts (pytest_configure)
                    client.execute()
                except Exception as e:  # the failing cell's traceback, reported by the test that asks
                    error = f"{type(e).__name__}: {e}"
                nbformat.write(nb, str(out))
                meta.write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1), "error": error}))
        return out, json.loads(meta.read_text())

    return get
