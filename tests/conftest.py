"""What the whole suite shares: one model zoo (tests/zoo.py), the tiers (markers) and the groups that keep servers,
kernels and compiled graphs shared when the suite runs in workers (``pytest -n 3``, see docs/testing.md).

Tiers, by what a test needs (``slow`` is their union; the fast tier is ``-m "not slow"``):

- ``browser``: headless Chromium with JupyterLab, Voila or a replay page;
- ``notebooks``: the course notebooks executed in a kernel;
- ``smollm2``: the real SmolLM2-135M (a 93 MB download the first time);
- ``gemma3``: the real Gemma 3 270M (about 240 MB the first time, then transformers' reference once);
- ``compile``: torch.compile of a model (inductor's C++ code, tens of seconds the first time);
- ``install``: a fresh virtual environment built with pip (the package without its notebook extra);
- ``long``: a test on the tiny models that runs for seconds (hundreds of steps against a recomputation, a whole
  matrix of architectures and caches, subprocesses that import the package, a sampled distribution): the tests named
  in :data:`LONG`, and two cases of every three of the matrices in :data:`SAMPLED`. Each has quicker neighbours in the
  fast tier that check the same code on fewer cases.

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
# the tests of the ``long`` tier (file::function, every parameter): each takes 2 to 17 s at a slow pace of the machine,
# together about half of what the fast tier would otherwise take; a name that no longer exists fails the collection
LONG = frozenset({
    "test_hostile.py::test_every_damaged_file_gets_a_kvexplore_error",  # 150 damaged files, each in a subprocess
    "test_hostile.py::test_every_misuse_is_refused_and_changes_nothing",
    "test_hostile.py::test_the_pristine_files_load_and_generate",
    "test_hostile.py::test_nonfinite_weights_load_when_allowed",
    "test_hf.py::test_doctor_command_in_its_own_process",  # imports transformers in a subprocess
    "test_install.py::test_the_engine_works_with_the_widget_libraries_unimportable",
    "test_install.py::test_with_the_extra_the_widgets_load_on_first_use",
    "test_cli.py::test_console_script",
    "test_replay.py::test_a_saved_trace_writes_its_replay_after_a_plain_import",
    "test_speculative.py::test_sampled_tokens_are_distributed_as_the_targets",  # thousands of samples
    "test_speculative.py::test_greedy_drafting_gives_plain_greedy_tokens",  # 49 architectures x caches
    "test_strategies.py::test_200_steps_with_rewinds_and_forks_match_recomputation",
    "test_quantized.py::test_top1_agreement_with_the_full_precision_cache",
    "test_parity_state.py::test_the_recurrent_layers_hold_the_same_bytes_after_8_and_400_tokens",
    "test_parity_state.py::test_64_greedy_tokens_match_transformers",
    "test_parity_2025.py::test_64_greedy_tokens_match_transformers",
    "test_parity_latent.py::test_64_greedy_tokens_match_transformers",
    "test_device.py::test_tracing_does_not_change_low_precision_logits",
    "test_device.py::test_generator_every_cache_and_the_tracer_convert_only_through_host",
    "test_explorer.py::test_every_view_is_json_safe_for_every_strategy",
    "test_long_context.py::test_held_memory_is_bounded_whatever_the_number_of_steps",
    "test_sink.py::test_generator_runs_300_steps_with_flat_memory",
    "test_evict.py::test_properties_of_what_a_press_keeps",
    # the fast tier's heaviest (1-3 s each, together about a sixth of its time; 2026-12-06), each beside a quicker
    # neighbour on the same code: a long prompt's growth and refusal (test_grow_false_keeps_the_size), the status at
    # the end of sequence, the Voila template's links, a 50-request replay page, drafting through rings and presses,
    # the tiny model's perplexity, a 200-token window, a binned speculation view, the export command
    "test_app_page.py::test_a_long_prompt_grows_the_caches_and_a_short_one_gives_back_the_size_asked",
    "test_app_page.py::test_a_prompt_beyond_the_context_is_refused_and_changes_nothing",
    "test_explorer.py::test_status_and_map_title_give_one_slot_figure_and_the_end_of_sequence",
    "test_launch.py::test_the_voila_lab_template_links_nothing_remote_but_what_ours_filters_out",
    "test_prefix_views.py::test_replay_page_of_50_requests_on_512_blocks_stays_small",
    "test_speculative.py::test_ring_wraps_inside_drafts_give_plain_greedy",
    "test_speculative.py::test_evicting_and_flushing_caches_of_any_size_give_plain_greedy",
    "test_speculative.py::test_recurrent_states_checkpoint_or_recompute_alike",
    "test_tiny.py::test_held_out_perplexity_is_what_the_card_says",
    "test_parity_2025.py::test_gemma3_window_16_holds_16_positions_in_local_layers_over_200_tokens",
    "test_speculative_views.py::test_binned_steps_keep_every_count",
    "test_replay.py::test_export_command_and_save_html",
})
# matrices of cases (architectures x caches, presses x layer kinds): the fast tier runs every third case of each, in
# collection order, and the ``long`` tier the rest (the full suite runs all of them)
SAMPLED = frozenset({
    "test_speculative.py::test_after_every_take_back_the_cache_never_saw_the_rejected_drafts",
    "test_speculative.py::test_undo_step_takes_a_verification_back_exactly",
    "test_speculative.py::test_a_failed_verification_leaves_everything_as_it_was",
    "test_speculative.py::test_rewinding_into_a_verification_then_running_again_gives_plain_greedy",
    "test_evict_doctor.py::test_the_doctor_finds_nothing_on_a_press_lane",
    "test_evict_doctor.py::test_the_doctor_checks_press_lanes_beside_rings_states_sinks_and_shared_layers",
    "test_hf.py::test_greedy_tokens_match_generate_and_bytes_match_the_storage",
    "test_hf.py::test_the_doctor_finds_nothing_on_unmodified_models",
    "test_hf.py::test_speculative_decoding_on_transformers_caches_gives_plain_greedy_tokens",
    "test_evict.py::test_decoding_presses_score_what_is_held_as_the_reference",
    "test_evict.py::test_decoding_after_eviction_equals_the_recomputation_with_the_same_kept_set",
    "test_held_memory.py::test_the_report_counts_every_byte_reachable",
    "test_device.py::test_every_explorer_view_converts_only_through_host",
})
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


def _long_name(item) -> str:
    return f"{Path(str(item.path)).name}::{getattr(item, 'originalname', item.name)}"


def pytest_collection_modifyitems(config, items):
    modules = {Path(str(item.path)).name: item.module for item in items if getattr(item, "module", None)}
    gone = [name for name in LONG | SAMPLED
            if (m := modules.get(name.split("::")[0])) and not hasattr(m, name.split("::")[1])]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py's LONG or SAMPLED names tests that do not exist: {sorted(gone)}")
    cases: dict[str, int] = {}  # each SAMPLED function's cases seen so far
    for item in items:
        name = _long_name(item)
        if name in SAMPLED:
            cases[name] = cases.get(name, -1) + 1
        if name in LONG or (name in SAMPLED and cases[name] % SAMPLE_EVERY):
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

    def order(item) -> tuple[int, int]:
        browser, notebooks = item.get_closest_marker("browser"), item.get_closest_marker("notebooks")
        if browser and notebooks:
            return (1 if _notebook_path(item) in tail else 3), -position[id(item)]
        return (0 if notebooks else 2), position[id(item)]

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
                    f"(tests/zoo.py). The fast tier runs where no model was ever fetched.", pytrace=False)

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
                try:
                    client.execute()
                except Exception as e:  # the failing cell's traceback, reported by the test that asks
                    error = f"{type(e).__name__}: {e}"
                nbformat.write(nb, str(out))
                meta.write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1), "error": error}))
        return out, json.loads(meta.read_text())

    return get
