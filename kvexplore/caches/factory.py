"""``make_cache``: any strategy by name, with the model's dtype and device unless told otherwise."""

from __future__ import annotations

from typing import Any

import torch

from .base import KVCache
from .concat import ConcatCache
from .none import NoCache
from .paged import PagedCache
from .preallocated import PreallocatedCache
from .quantized import QuantizedCache
from .sink import SinkCache
from ..errors import SettingsError
from .memory import kv_bytes
from ..core.devices import resolve_device
from ..core.settings import choice, positive_int

STRATEGIES: dict[str, type[KVCache]] = {
    "preallocated": PreallocatedCache,
    "concat": ConcatCache,
    "none": NoCache,
    "paged": PagedCache,
    "quantized": QuantizedCache,
    "sink": SinkCache,
}
BOUNDED = {"preallocated", "paged", "quantized"}  # kinds whose storage is sized by max_seq_len


def make_cache(kind: str, model: Any, max_seq_len: int | None = None, batch_size: int = 1,
               dtype: torch.dtype | None = None, device: str | torch.device | None = None,
               **strategy_options: Any) -> KVCache:
    """Build a cache of ``kind`` (see :data:`STRATEGIES`) for ``model``.

    ``max_seq_len`` sizes the storage (default: the model's context, at most 2048; for ``sink`` the ring of
    ``sinks + window`` slots unless ``window`` is given; ``concat`` and ``none`` grow or hold nothing); ``dtype`` and
    ``device`` default to the model's. Other keyword arguments go to the strategy's constructor.
    """
    if isinstance(kind, str) and kind.startswith("hf:"):  # transformers' own caches (kvexplore.hf)
        from .. import hf

        return hf.make_cache(model, kind, max_seq_len)
    choice(kind, "cache kind", STRATEGIES)
    if max_seq_len is not None:
        positive_int(max_seq_len, "max_seq_len")
    positive_int(batch_size, "batch_size")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise SettingsError(f"dtype must be a torch.dtype such as torch.float32 (or None for the model's), got "
                            f"{dtype!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise SettingsError(f"dtype {dtype} cannot hold keys and values; use a floating-point dtype")
    if device is not None:
        device = resolve_device(device)
    common = dict(batch_size=batch_size, dtype=dtype or model.dtype, device=device or model.device)
    slots = max_seq_len or min(model.config.max_position_embeddings, 2048)
    if kind in BOUNDED:
        common["max_seq_len"] = slots
    elif kind == "sink" and "window" not in strategy_options:  # the ring gets the slots: sinks + window
        sinks = strategy_options.get("sinks", 4)
        if isinstance(sinks, int) and not isinstance(sinks, bool) and slots <= sinks:
            raise SettingsError(f"max_seq_len={slots} leaves no window after sinks={sinks}: a sink cache holds "
                                f"sinks + window slots; give max_seq_len > {sinks} or window= explicitly")
        strategy_options["window"] = slots - sinks if isinstance(sinks, int) else slots
    if kind in BOUNDED or kind == "sink":
        positions = slots if kind in BOUNDED else strategy_options.get("window", 0)
        if isinstance(positions, int):
            _check_fits(kind, model, positions + (strategy_options.get("sinks", 4) if kind == "sink" else 0),
                        batch_size, common["dtype"], common["device"])
    try:
        return STRATEGIES[kind](model.config, **common, **strategy_options)
    except TypeError as e:
        raise SettingsError(f"cache kind {kind!r} does not take {sorted(strategy_options)}: {e}") from e


def _check_fits(kind: str, model: Any, slots: int, batch_size: int, dtype: torch.dtype,
                device: torch.device) -> None:
    """Refuse, before allocating, a cache larger than the device's memory (it would fail or swap for minutes)."""
    need = kv_bytes(model.config, slots, batch_size, dtype)
    if device.type == "cuda":
        have = torch.cuda.mem_get_info(device)[0]
        where = f"free on {device}"
    else:
        import os

        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        where = "of this machine's memory"
    if need > have:
        raise SettingsError(f"a {kind} cache of {slots} positions needs {need / 2**30:.1f} GiB, more than the "
                            f"{have / 2**30:.1f} GiB {where}; give a smaller max_seq_len")
