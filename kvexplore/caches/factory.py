"""``make_cache``: any strategy by name, with the model's dtype and device unless told otherwise. The names come from
the registries (:mod:`.registry`): :data:`STRATEGIES` for kvexplore's strategies, and name prefixes other packages
register (``"hf:"``: transformers' caches, registered by :mod:`kvexplore.hf`)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.devices import resolve_device
from ..core.settings import choice, positive_int, refused_options
from ..errors import SettingsError
from .base import KVCache
from .memory import kv_bytes
from .registry import STRATEGIES, prefix_factory


def make_cache(kind: str, model: Any, max_seq_len: int | None = None, batch_size: int = 1,
               dtype: torch.dtype | None = None, device: str | torch.device | None = None,
               **strategy_options: Any) -> KVCache:
    """Build a cache of ``kind`` (see :data:`STRATEGIES`, or a registered prefix such as ``"hf:"``) for ``model``.
    ``max_seq_len`` sizes the storage (default: the model's context, at most 2048; for ``sink`` the ring of ``sinks +
    window`` slots unless ``window`` is given; ``concat`` and ``none`` grow or hold nothing); ``dtype`` and ``device``
    default to the model's. Other keyword arguments are the strategy's options (its ``Options``: one it does not take is
    refused, naming those it takes)."""
    if (make := prefix_factory(kind)) is not None:  # another package's caches (kvexplore.hf: "hf:...")
        return make(model, kind, max_seq_len)
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
    cls = STRATEGIES[kind]
    declared = getattr(cls, "Options", None)  # the strategy's options (kvexplore.caches.options)
    positions = None
    if declared is not None:
        declared.refuse_unknown(strategy_options, f"cache kind {kind!r}")
        positions = declared.sizing(slots, strategy_options)
    if positions is not None:
        _check_fits(kind, model, positions, batch_size, common["dtype"], common["device"])
    try:
        return cls(model.config, **common, **strategy_options)
    except TypeError as e:
        raise refused_options(cls, strategy_options, f"cache kind {kind!r}", e) from e


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
