"""The lossy caches' facet (:class:`~kvexplore.caches.protocol.Quantization`, ``cache.quantization``): what their
lossy full layers record, asked through the cache. A strategy that stores lossily subclasses :class:`LossyStorage`
with the bound of its codes (:meth:`LossyStorage.error_bound`) and returns one from its ``quantization``."""

from __future__ import annotations

from typing import Any

import torch


class LossyStorage:
    """``cache``'s lossy storage: the full layers' records (``stored_error(length)``, ``channel_error()``,
    ``channel_detail()`` of the layer object), None for the layers it keeps exact (rings, shared, states)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache

    def _lossy(self, layer: int) -> Any:
        return self.cache.layers[layer] if layer in self.cache.full_layers else None

    def stored_error(self, layer: int) -> torch.Tensor | None:
        target = self._lossy(layer)
        return None if target is None else target.stored_error(self.cache.length)

    def channel_error(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        target = self._lossy(layer)
        return None if target is None else target.channel_error()

    def channel_detail(self, layer: int) -> tuple[Any, Any] | None:
        target = self._lossy(layer)
        return None if target is None else target.channel_detail()

    def error_bound(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple | None:
        raise NotImplementedError(f"{type(self).__name__} says how far its codes may be off: define error_bound")
