"""``kvexplore lab`` / ``kvexplore app``: the copy logic, the command lines, the arguments, the clear error when
JupyterLab or Voila is missing, and the packaging that ships the notebooks. No server is started here
(tests/screen/test_browser.py does that)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kvexplore.cli import commands as cli

from kvexplore.cli import launch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _nb(folder: Path, name: str, text: str = "original") -> Path:
    path = folder / name
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "source": text}],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


@pytest.fixture
def bundle(tmp_path):
    src = tmp_path / "bundle"
    src.mkdir()
    for name in ("02_second.ipynb", "01_first.ipynb", "03_third.ipynb"):
        _nb(src, name, f"bundled {name}")
    (src / "README.md").write_text("not a notebook")
    return src


@pytest.fixture
def no_exec(monkeypatch):
    """Record what would be exec'd instead of replacing the test process."""
    calls = []
    monkeypatch.setattr(launch, "_replace_process", lambda argv, env=None: calls.append((argv, env)) or 0)
    return calls


def test_bundled_notebooks_are_the_ipynb_files_in_name_order(bundle):
    assert [p.name for p in launch.bundled_notebooks(bundle)] == ["01_first.ipynb", "02_second.ipynb", "03_third.ipynb"]


def test_first_run_copies_every_notebook_in_order(bundle, tmp_path):
    dest = tmp_path / "home" / "kvexplore-notebooks"  # created, parents too
    report = launch.copy_notebooks(dest, launch.bundled_notebooks(bundle))
    assert report.copied == ["01_first.ipynb", "02_second.ipynb", "03_third.ipynb"] and report.kept == []
    assert report.folder == dest.resolve()
    for name in report.copied:
        assert (dest / name).read_bytes() == (bundle / name).read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == report.copied  # no README, no temporary files left
    assert "copied: 01_first.ipynb, 02_second.ipynb, 03_third.ipynb" in report.summary()


def test_a_second_run_keeps_edited_files_and_copies_only_missing_ones(bundle, tmp_path):
    dest = tmp_path / "mine"
    launch.copy_notebooks(dest, launch.bundled_notebooks(bundle))
    _nb(dest, "02_second.ipynb", "my edits")
    edited = (dest / "02_second.ipynb").read_bytes()
    (dest / "03_third.ipynb").unlink()
    _nb(dest, "99_my_own.ipynb", "mine")
    report = launch.copy_notebooks(dest, launch.bundled_notebooks(bundle))
    assert report.copied == ["03_third.ipynb"]
    assert report.kept == ["01_first.ipynb", "02_second.ipynb"]
    assert (dest / "02_second.ipynb").read_bytes() == edited  # never overwritten
    assert (dest / "99_my_own.ipynb").exists()
    summary = report.summary()
    assert "copied: 03_third.ipynb" in summary and "kept as they are" in summary and "02_second.ipynb" in summary


def test_the_bundled_notebooks_themselves_are_never_written(bundle, tmp_path):
    before = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in bundle.iterdir()}
    dest = tmp_path / "d"
    launch.copy_notebooks(dest, launch.bundled_notebooks(bundle))
    _nb(dest, "01_first.ipynb", "edited")
    launch.copy_notebooks(dest, launch.bundled_notebooks(bundle))
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in bundle.iterdir()} == before


def test_an_unwritable_folder_is_one_clear_error(bundle, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(launch.LaunchError, match="cannot create the notebooks folder .*--dir"):
        launch.copy_notebooks(blocker / "sub", launch.bundled_notebooks(bundle))


def test_the_installed_package_finds_the_repository_notebooks():
    found = [p.name for p in launch.bundled_notebooks()]
    assert found == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
    assert launch.app_notebook().is_file()


def test_lab_copies_then_runs_jupyterlab_on_the_folder(bundle, tmp_path, monkeypatch, no_exec, capsys):
    monkeypatch.setattr(launch, "bundled_notebooks", lambda root=None: sorted(bundle.glob("*.ipynb")))
    monkeypatch.setattr(launch, "_is_root", lambda: False)  # the exact command line (root adds --allow-root)
    dest = tmp_path / "nbs"
    assert cli.main(["lab", "--dir", str(dest), "--port", "8123", "--no-browser", "--ServerApp.token=abc"]) == 0
    (argv, env), = no_exec
    assert argv == [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={dest.resolve()}", "--port=8123",
                    "--no-browser", "--ServerApp.token=abc"]
    assert env is None
    out = capsys.readouterr().out
    assert str(dest.resolve()) in out and "copied: 01_first.ipynb, 02_second.ipynb, 03_third.ipynb" in out


def test_lab_defaults_to_a_folder_in_home(bundle, tmp_path, monkeypatch, no_exec):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path / "elsewhere"))  # the notebooks folder does not follow it
    monkeypatch.setattr(launch, "bundled_notebooks", lambda root=None: sorted(bundle.glob("*.ipynb")))
    assert cli.main(["lab"]) == 0
    (argv, _), = no_exec
    assert argv[3] == f"--ServerApp.root_dir={(tmp_path / 'kvexplore-notebooks').resolve()}"
    assert "--no-browser" not in argv and not any(a.startswith("--port") for a in argv)
    assert (tmp_path / "kvexplore-notebooks" / "01_first.ipynb").exists()


@pytest.mark.parametrize("command, module, name", [("lab", "jupyterlab", "JupyterLab"), ("app", "voila", "Voila"),
                                                  ("lab", "plotly", "plotly"), ("app", "anywidget", "anywidget")])
def test_missing_jupyter_is_one_line_naming_the_extra(command, module, name, tmp_path, monkeypatch, no_exec, capsys):
    real = launch.importlib.util.find_spec
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda m, *a: None if m == module else real(m, *a))
    assert cli.main([command, "--dir", str(tmp_path / "x")] if command == "lab" else [command]) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.startswith(f"kvexplore {command}: error: {name} is not installed")
    assert 'install the notebook extra: pip install "kvexplore[notebook]"' in err
    assert no_exec == [] and not (tmp_path / "x").exists()  # nothing copied, nothing started


def test_app_serves_the_explorer_notebook_with_voila_on_loopback(no_exec, monkeypatch):
    monkeypatch.setenv("KVEXPLORE_APP_STRATEGIES", "stale")
    assert cli.main(["app", "--port", "8866", "--no-browser"]) == 0
    (argv, env), = no_exec
    assert argv[:3] == [sys.executable, "-m", "voila"]
    assert Path(argv[3]).name == "app.ipynb" and Path(argv[3]).parent.name == "explorer"
    assert "--Voila.ip=127.0.0.1" in argv and "--port=8866" in argv and "--no-browser" in argv
    assert env["KVEXPLORE_APP_MODEL"] == "tiny" and "KVEXPLORE_APP_STRATEGIES" not in env
    assert env["KVEXPLORE_APP_PROMPT"] == "Call me Ishmael." and env["KVEXPLORE_APP_MAX_SEQ_LEN"] == "128"


def test_app_passes_model_and_strategies_to_the_notebook(no_exec):
    assert cli.main(["app", "--model", "smollm2-135m", "--strategies", "paged, sink", "--prompt", "",
                     "--max-seq-len", "4096", "--", "--VoilaConfiguration.show_tracebacks=True"]) == 0
    (argv, env), = no_exec
    assert env["KVEXPLORE_APP_MODEL"] == "smollm2-135m" and env["KVEXPLORE_APP_STRATEGIES"] == "paged,sink"
    assert env["KVEXPLORE_APP_PROMPT"] == "" and env["KVEXPLORE_APP_MAX_SEQ_LEN"] == "4096"
    assert argv[-1] == "--VoilaConfiguration.show_tracebacks=True" and "--no-browser" not in argv
    assert not any(a.startswith("--port") for a in argv)


@pytest.mark.parametrize("argv, message", [
    (["app", "--strategies", "preallocated,bogus"], "unknown cache strategy 'bogus'; available: preallocated"),
    (["app", "--strategies", ","], "unknown cache strategy"),
    (["app", "--max-seq-len", "0"], "argument --max-seq-len: must be a positive integer, got 0"),
    (["lab", "--port", "70000"], "must be a port number"),
    (["lab", "--port", "x"], "invalid _port value"),
    (["generate", "x", "--prompt", "p", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_parse_args_keeps_extra_arguments_for_lab_only():
    args = cli.parse_args(["lab", "--dir", "d", "--LabApp.default_url=/lab/tree/01_tour.ipynb"])
    assert args.dir == "d" and args.port is None and not args.no_browser
    assert args.extra == ["--LabApp.default_url=/lab/tree/01_tour.ipynb"]
    args = cli.parse_args(["app"])
    assert (args.model, args.strategies, args.port, args.extra) == ("tiny", None, None, [])
    assert cli.parse_args(["app", "--strategies", "paged,quantized"]).strategies == ("paged", "quantized")


def test_app_notebook_is_committed_clean_and_reads_the_environment():
    path = ROOT / "kvexplore" / "explorer" / "app.ipynb"
    nb = json.loads(path.read_text())
    kinds = [c["cell_type"] for c in nb["cells"]]
    assert kinds == ["markdown", "code", "code"]  # the explorer shown, then its first prompt prefilled
    assert all(not c["outputs"] and c["execution_count"] is None for c in nb["cells"][1:])
    assert "widgets" not in nb["metadata"]
    source = "".join(nb["cells"][1]["source"])
    assert "from kvexplore.explorer.app_page import app_explorer, app_start, app_view" in source
    assert "app_explorer(start=False)" in source and source.rstrip().endswith("app_view(explorer)")
    assert "app_start(explorer)" in "".join(nb["cells"][2]["source"])
    # what the page reads is what the command line writes
    from kvexplore.explorer import app_page

    env = launch.app_environment("smollm2-135m", ("paged", "sink"), "Hello", base={}, max_seq_len=512,
                                 options={"sink": {"window": 64}})
    assert {k: env[k] for k in app_page.ENV} == {"KVEXPLORE_APP_MODEL": "smollm2-135m",
                                                  "KVEXPLORE_APP_STRATEGIES": "paged,sink",
                                                  "KVEXPLORE_APP_PROMPT": "Hello", "KVEXPLORE_APP_MAX_SEQ_LEN": "512",
                                                  "KVEXPLORE_APP_OPTIONS": '{"sink": {"window": 64}}'}
    # the app's own options at a class's sizes, under the ones given
    assert app_page.settings(env) == {"source": "smollm2-135m", "strategies": ("paged", "sink"), "max_seq_len": 512,
                                      "strategy_options": {"paged": {"block_size": 8},
                                                           "sink": {"sinks": 4, "window": 64}}}
    assert "KVEXPLORE_APP_OPTIONS" not in launch.app_environment("tiny", None, base=env)
    assert app_page.settings({})["strategies"] == ("preallocated", "concat", "paged")


def test_every_package_folder_is_listed_in_pyproject():
    """pyproject lists packages explicitly (kvexplore.notebooks is mapped from notebooks/, which discovery cannot
    do); a new subpackage missing from the list would silently be left out of wheels."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "kvexplore").rglob("*.py")}
    assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert setuptools["package-dir"]["kvexplore.notebooks"] == "notebooks"
    assert "*.ipynb" in setuptools["package-data"]["kvexplore.notebooks"]
    assert "*.ipynb" in setuptools["package-data"]["kvexplore.explorer"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(r.startswith("voila") for r in extras["notebook"])
    assert {"nbclient", "nbformat", "ipykernel", "playwright"} <= {r.split(">")[0].split("=")[0] for r in extras["dev"]}


def test_lab_as_root_allows_root(monkeypatch):
    """JupyterLab refuses to start as root unless told; kvexplore lab tells it (containers, CI machines)."""
    from kvexplore.cli import launch

    monkeypatch.setattr(launch, "_is_root", lambda: True)
    assert "--allow-root" in launch.lab_command("/tmp", port=8899)
    assert launch.lab_command("/tmp", extra=["--allow-root"]).count("--allow-root") == 1
    monkeypatch.setattr(launch, "_is_root", lambda: False)
    assert "--allow-root" not in launch.lab_command("/tmp")


def test_app_uses_the_packaged_voila_template_that_links_nothing_remote(monkeypatch):
    """``kvexplore app`` renders with kvexplore's Voila template (Voila's "lab" template minus the two Font Awesome
    stylesheets that one links from cdn.jsdelivr.net): the option is on the command line, the template ships inside
    the installed package where ``JUPYTER_PATH`` points Voila, and it adds no remote URL of its own."""
    from importlib import resources

    argv = launch.app_command("app.ipynb", port=8866)
    assert "--template=kvexplore" in argv and argv.index("--template=kvexplore") < argv.index("--port=8866")
    assert "--VoilaConfiguration.progressive_rendering=True" in argv  # the page shows before the first prefill
    template = resources.files("kvexplore").joinpath("explorer", "voila_template")
    assert launch.app_template() == template
    assert json.loads(template.joinpath("conf.json").read_text()) == {"base_template": "lab"}
    page = template.joinpath("index.html.j2").read_text()
    assert "https://" not in page and "http://" not in page
    assert "{%- extends 'voila/templates/lab/index.html.j2' -%}" in page and "block notebook_css" in page
    assert "cdn.jsdelivr.net/npm/@fortawesome/fontawesome-free" in page  # the lines it filters out

    # Voila looks for <JUPYTER_PATH entry>/voila/templates/<name>: the package's data folder comes first, whether
    # JUPYTER_PATH was unset or already held entries (kept after it, in order, without a duplicate of ours)
    data = launch.app_jupyter_data()
    for name in ("conf.json", "index.html.j2"):  # a copy of the package's template, laid out for Voila
        assert (data / "voila" / "templates" / "kvexplore" / name).read_text() == template.joinpath(name).read_text()
    assert launch.app_jupyter_data() == data  # one folder per process
    monkeypatch.delenv("JUPYTER_PATH", raising=False)
    assert launch.app_environment("tiny", None)["JUPYTER_PATH"] == str(data)
    assert launch.app_environment("tiny", None, base={})["JUPYTER_PATH"] == str(data)
    base = {"JUPYTER_PATH": os.pathsep.join(["/a", str(data), "/b"])}
    assert launch.app_environment("tiny", None, base=base)["JUPYTER_PATH"].split(os.pathsep) == [str(data), "/a", "/b"]
    assert base["JUPYTER_PATH"].startswith("/a")  # the caller's dict is not changed


@pytest.mark.long  # the fast tier's heaviest (1-3 s): Voila's template
def test_the_voila_lab_template_links_nothing_remote_but_what_ours_filters_out():
    """If a Voila upgrade adds another remote link to the "lab" template's stylesheets, or changes the Font Awesome
    ones so that our filter no longer matches them, say so here rather than in an offline browser."""
    voila = pytest.importorskip("voila")
    from voila.paths import collect_template_paths

    lab = next(Path(p) / "index.html.j2" for p in collect_template_paths(["voila"], "lab")
               if (Path(p) / "index.html.j2").is_file())
    text = lab.read_text()
    block = text[text.index("{%- block notebook_css -%}"):text.index("{%- endblock notebook_css -%}")]
    remote = [line.strip() for line in block.splitlines() if "://" in line]
    assert len(remote) == 2 and all("cdn.jsdelivr.net/npm/@fortawesome/fontawesome-free" in line for line in remote), (
        f"{lab} (voila {voila.__version__}) changed its remote links: {remote}; update "
        "kvexplore/explorer/voila_template/index.html.j2")


def test_app_takes_each_lanes_options_and_refuses_a_wrong_one_or_an_unknown_model_before_the_server_starts(capsys):
    from kvexplore.explorer.app_page import app_options

    args = cli.parse_args(["app", "--model", "smollm2-135m", "--strategies", "preallocated,quantized,sink,evict",
                           "--strategy-option", "sink.window=256", "--strategy-option", "quantized.bits=2",
                           "--strategy-option", "evict.press=snapkv", "--strategy-option", "evict.decode_every=16"])
    assert app_options(args.model, args.strategies, args.strategy_option) == {
        "sink": {"window": 256}, "quantized": {"bits": 2}, "evict": {"press": "snapkv", "decode_every": 16}}
    for argv, said in [
        (["app", "--model", "smolm2-135m"], "did you mean 'smollm2-135m'?"),
        (["app", "--strategy-option", "sink.window=8"], "'sink', which is not a lane: the lanes are preallocated"),
        (["app", "--strategies", "sink", "--strategy-option", "sink.bits=2"], "a sink cache does not take 'bits'"),
        (["app", "--strategy-option", "window=8"], "give LANE.OPTION=VALUE"),
    ]:
        assert cli.main(argv) == 1  # refused: voila never started
        assert said in capsys.readouterr().err
