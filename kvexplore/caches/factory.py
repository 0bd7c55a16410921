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
    if kind not in STRATEGIES:
        raise SettingsError(f"unknown cache kind {kind!r}; available: {', '.join(STRATEGIES)}")
    common = dict(batch_size=batch_size, dtype=dtype or model.dtype, device=device or model.device)
    slots = max_seq_len or min(model.config.max_position_embeddings, 2048)
    if kind in BOUNDED:
        common["max_seq_len"] = slots
    elif kind == "sink" and "window" not in strategy_options:  # the ring gets the slots: sinks + window
        strategy_options["window"] = max(1, slots - strategy_options.get("sinks", 4))
    try:
        return STRATEGIES[kind](model.config, **common, **strategy_options)
    except TypeError as e:
        raise SettingsError(f"cache kind {kind!r} does not take {sorted(strategy_options)}: {e}") from None
