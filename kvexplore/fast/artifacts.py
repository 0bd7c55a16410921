"""Compiled graphs saved for a later process: ``$KVEXPLORE_HOME/compiled/`` (or ``$KVEXPLORE_COMPILED``), one file
per graph, and what a compile says about them.

Each graph is inductor's bundled artifact (generated code, no weights: they are the graph's inputs), named by a hash
of everything the compiled code depends on (:func:`graph_key`); a later process traces the layer again and loads the
file instead of compiling (where ``$TORCHINDUCTOR_CACHE_DIR`` was cleared, it rebuilds the C++ kernels from the
saved code). ``compiled.json`` remembers per step which files were saved with which torch and threads, so a
compile can say whether it loaded, found the saved step stale or missing, or saved it first.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch


def home_folder() -> Path:
    """Where compiled graphs are saved: ``$KVEXPLORE_COMPILED``, by default ``$KVEXPLORE_HOME/compiled``."""
    from ..formats.store import home
    return Path(os.environ.get("KVEXPLORE_COMPILED") or home() / "compiled").expanduser()


def machine() -> str:
    """What a compiled CPU kernel depends on besides its code: the CPU's vector instructions and the threads."""
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except AttributeError:  # an older torch
        isa = "unknown"
    return f"{isa}, {torch.get_num_threads()} threads"


def step_key(model: Any, capacity: int, mode: str) -> str:
    """One compiled step: the model (its source, or its architecture), dtype, capacity and mode."""
    source = getattr(model, "source", None) or model.config.architecture
    return f"{source} | {str(model.dtype).replace('torch.', '')} | {capacity} slots | {mode}"


def graph_key(gm: torch.fx.GraphModule, inputs: list[Any], options: dict) -> str:
    """The file name of the compiled ``gm`` for ``inputs`` under ``options`` (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(gm.code.encode())
    for t in inputs:
        h.update(repr((tuple(t.shape), t.stride(), t.dtype, t.device.type) if isinstance(t, torch.Tensor)
                      else t).encode())
    h.update(f"{torch.__version__}|{machine()}|{sorted(options.items())}".encode())
    return h.hexdigest()


class Saved:
    """What was saved before, by which torch, per step: ``compiled.json`` in ``folder`` (or another file of it,
    ``name``: the product kernels' verdicts are ``products.json``)."""

    def __init__(self, folder: Path | None = None, name: str = "compiled.json") -> None:
        self.folder = Path(folder) if folder is not None else home_folder()
        self.path = self.folder / name

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, step: str) -> dict | None:
        return self._read().get(step)

    def put(self, step: str, entry: dict) -> bool:
        saved = self._read()
        saved[step] = entry
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")  # processes that compile at once: one file each
            tmp.write_text(json.dumps(saved, indent=1, sort_keys=True))
            tmp.replace(self.path)
            return True
        except OSError:  # a read-only home: the note still says what happened in this process
            return False

    def file(self, key: str) -> Path:
        return self.folder / f"{key}.bin"


def load(saved: Saved, key: str) -> Callable | None:
    """The compiled graph saved under ``key`` (None where there is none, or it cannot be read)."""
    path = saved.file(key)
    if not path.exists():
        return None
    from torch._inductor import CompiledArtifact
    try:
        return CompiledArtifact.load(path=str(path), format="binary")
    except Exception:  # written by another torch, cut short: compiled again
        return None


def store(saved: Saved, key: str, artifact: Any) -> bool:
    """Save ``artifact`` under ``key``; False where the folder cannot be written."""
    path = saved.file(key)
    try:
        saved.folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        artifact.save(path=str(tmp), format="binary")
        tmp.replace(path)
        return True
    except OSError:
        return False


def note(saved: Saved, step: str, keys: list[str], built: int, stored: bool) -> str:
    """What the compile of ``step`` did (its graphs ``keys``, ``built`` of them compiled here), and remember it."""
    where = saved.folder
    earlier = saved.get(step)
    now = {"torch": torch.__version__, "machine": machine(), "files": keys,
           "saved": time.strftime("%Y-%m-%d %H:%M:%S")}
    if not built:
        return f"loaded the compiled graphs an earlier process saved ({where}): nothing compiled"
    if not stored or not saved.put(step, now):
        return f"compiled; not saved for a later process ({where} cannot be written)"
    if earlier is None:
        return f"compiled and saved in {where}: a later process loads it"
    if earlier.get("torch") != now["torch"]:
        return (f"the step saved with torch {earlier.get('torch')} is stale (torch {now['torch']} now): rebuilt and "
                f"saved")
    if earlier.get("machine") != now["machine"]:
        return (f"compiled for {now['machine']} and saved (the step saved before was built for "
                f"{earlier.get('machine')}; each is kept)")
    if earlier.get("files") != keys:
        return ("the step saved before is stale (another version of the model's layer code, config or shapes): "
                "rebuilt and saved")
    return f"the step saved before was not in {where} (cleared?): rebuilt and saved"
