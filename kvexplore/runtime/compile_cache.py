"""Compiled steps that a later process can reuse, and what each compile says about it.

inductor keeps every graph it compiles in its FX graph cache (a folder: ``$TORCHINDUCTOR_CACHE_DIR``, by default
``/tmp/torchinductor_<user>``), keyed by the graph, the shapes, the compile options, the number of threads and the
torch version: a later process that compiles the same step loads the kernels instead of building them. The CPU's
compiled step (frozen weights, autotuned matrix products) is the one graph it refuses: its freezing passes pack each
linear layer's weight into a oneDNN (mkldnn) tensor, which the cache cannot save ("mkldnn tensors unpickleable").
Those packed products are also the fastest here, so they stay the default: every process compiles again.

``KVEXPLORE_COMPILE_REUSE=1`` trades the other way: :func:`unpacked_linears` leaves the packing out of kvexplore's
own compiles (a check the packing pass consults, wrapped once: other compiles in the process pack as before), the
products run on inductor's C++ GEMM over the frozen weights, and the graph is cached. Measured on this project's
2-core machine (float32, 2 threads): a later process loads the tiny model's step in about 6 s instead of compiling
it in 15-30 s, SmolLM2's in about 20 s instead of 80-100 s; each step then runs 25-40% slower (SmolLM2 7.96 ->
10.90 ms, tiny 1.8 -> 2.2-3.2 ms; bfloat16 tiny 1.9 -> 3.1 ms). A frozen graph holds the weights as constants, and
inductor's key covers their shapes, not their values: :func:`weights_fingerprint` goes into the key, so a model
with other weights of the same shapes does not load the first one's step.

:class:`Saved` remembers, in ``$KVEXPLORE_HOME/compiled.json``, which steps were saved with which torch and weights,
so a compile can say whether it reused a saved step, found it stale or missing, or saved a new one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

import torch


class _Switch:
    active = False  # inside one of kvexplore's compiles
    installed: bool | None = None  # whether the packing pass reads our check (None: not tried yet)


_SWITCH = _Switch()


def _install() -> bool:
    """Wrap the freezing pass's "is this linear packable" check once, before the pass registers it. False where
    torch has no such pass, or it registered before kvexplore's first compile (then its graphs are not cached)."""
    if _SWITCH.installed is not None:
        return _SWITCH.installed
    try:
        from torch._inductor.fx_passes import mkldnn_fusion as fusion
    except ImportError:
        _SWITCH.installed = False
        return False
    check, init = getattr(fusion, "_is_packable_linear", None), getattr(fusion, "_mkldnn_weight_pack_init", None)
    if check is None or init is None or not hasattr(init, "cache_info") or init.cache_info().currsize:
        _SWITCH.installed = False
        return False

    def packable(match: Any) -> bool:
        return not _SWITCH.active and check(match)

    fusion._is_packable_linear = packable
    _SWITCH.installed = True
    return True


def weights_fingerprint(model: Any) -> str:
    """A hash of every parameter and buffer of ``model`` (names, dtypes, shapes and bytes). A frozen graph holds the
    weights as constants, and inductor's cache key does not cover their values: without this, a model with other
    weights of the same shapes would load the first one's compiled step."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        t = t.detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _salted(salt: str) -> dict:
    """inductor options that put ``salt`` in its cache key: a post-grad pass that changes nothing and names it (a
    custom pass's ``uuid`` is part of the key, by design)."""
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:
        return {}

    class _Salt(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            return None

        def uuid(self) -> str:
            return salt

    return {"post_grad_custom_post_pass": _Salt()}


@contextmanager
def unpacked_linears() -> Iterator[bool]:
    """Inside: inductor's freezing leaves linear weights unpacked, so the graph can be cached. Yields whether it
    could arrange that."""
    installed = _install()
    _SWITCH.active = True
    try:
        yield installed
    finally:
        _SWITCH.active = False


REUSE = "KVEXPLORE_COMPILE_REUSE"


def reusable() -> bool:
    """Whether kvexplore's frozen CPU graphs are compiled so that inductor's cache keeps them (``$KVEXPLORE_COMPILE_REUSE``
    set to anything but "" or "0"): a later process loads the step, which runs slower (see the module docstring)."""
    return os.environ.get(REUSE, "") not in ("", "0")


def inductor_cache_dir() -> str:
    """The folder inductor caches compiled graphs in."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        return cache_dir()
    except Exception:  # an older torch: the default
        import getpass
        import tempfile
        return str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")


def _cache_counts() -> tuple[int, int, int]:
    from torch._dynamo.utils import counters
    c = counters["inductor"]
    return c["fxgraph_cache_hit"], c["fxgraph_cache_miss"], c["fxgraph_cache_bypass"]


class Saved:
    """What was compiled before, by which torch: ``$KVEXPLORE_HOME/compiled.json`` (``path``)."""

    def __init__(self, path: Path | None = None) -> None:
        if path is None:
            from ..formats.store import home
            path = home() / "compiled.json"
        self.path = path

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> dict | None:
        return self._read().get(key)

    def put(self, key: str, entry: dict) -> None:
        saved = self._read()
        saved[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")  # processes that compile at once: one file each
            tmp.write_text(json.dumps(saved, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError:  # a read-only home: the note still says what happened in this process
            pass


def step_key(model: Any, capacity: int, mode: str) -> str:
    """One compiled step: the model (its source, or its architecture), dtype, capacity and mode."""
    source = getattr(model, "source", None) or model.config.architecture
    return f"{source} | {str(model.dtype).replace('torch.', '')} | {capacity} slots | {mode}"


@contextmanager
def watched(model: Any, key: str, frozen: bool, saved: Saved | None = None) -> Iterator[dict]:
    """Around a step's first call (its compile): for a ``frozen`` graph the model's weights in inductor's cache key
    (a graph that takes them as inputs is keyed by their shapes alone, rightly), linear weights left unpacked.
    Yields a dict that, after the block, holds ``note``: whether the compiled step was reused from inductor's
    cache, rebuilt (stale or missing), built and saved, or not saved (refused, or the cache turned off)."""
    import torch._inductor.config as inductor

    out: dict = {}
    saved = saved or Saved()
    before = _cache_counts()
    unpack = frozen and reusable()
    if frozen:
        _install()  # at the first frozen compile, before the packing pass registers: a later one may unpack
    weights = weights_fingerprint(model) if unpack else "inputs"
    with unpacked_linears() if unpack else nullcontext(False) as installed, \
            inductor.patch(_salted(weights) if unpack else {}):
        yield out
    hit, miss, bypass = (a - b for a, b in zip(_cache_counts(), before))
    where = inductor_cache_dir()
    earlier = saved.get(key)
    now = torch.__version__
    if hit and not miss and not bypass:
        out["note"] = f"reused the compiled step an earlier process saved (inductor's cache, {where})"
    elif bypass and not unpack:
        out["note"] = (f"compiled; not saved for a later process: its linear weights are packed for oneDNN (the fastest "
                       f"step here), which inductor's cache cannot keep ({REUSE}=1 keeps the step for a later process, "
                       f"which then loads it in seconds; each step runs slower)")
    elif bypass:
        why = "" if installed else " (the process compiled a frozen graph before kvexplore did)"
        out["note"] = f"compiled; not saved for a later process: inductor's cache refused the graph{why}"
    elif not miss:
        out["note"] = ("compiled; not saved for a later process: inductor's FX graph cache took no part (turned off? "
                       "TORCHINDUCTOR_FX_GRAPH_CACHE)")
    elif earlier and earlier.get("torch") != now:
        out["note"] = (f"the compiled step saved with torch {earlier.get('torch')} is stale (torch {now} now): "
                       f"rebuilt and saved in {where}")
    elif earlier and earlier.get("weights") != weights:
        out["note"] = f"the compiled step saved for this model's earlier weights is stale: rebuilt and saved in {where}"
    elif earlier:
        out["note"] = f"the compiled step saved before was not in {where} (cleared?): rebuilt and saved"
    else:
        out["note"] = f"compiled and saved in {where}: a later process loads it"
    if miss and not bypass:
        saved.put(key, {"torch": now, "weights": weights, "saved": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "folder": where})
