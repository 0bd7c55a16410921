"""What a compiled step's layers see as their cache: pre-allocated storages written at a position tensor and read
whole under a mask over the capacity (the whole step's graph, :mod:`.compiled`, and one layer's, :mod:`.regional`)."""

from __future__ import annotations

from typing import Any

import torch


class InPlace:
    """The cache a compiled step's layers see (the module docstring says what it holds)."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], pos: torch.Tensor,
                 mask: torch.Tensor) -> None:
        self.keys, self.values, self.pos, self._mask = keys, values, pos, mask

    eviction = None  # no press reads the queries of a compiled step

    def write(self, layer: int, pos: Any, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer].index_copy_(2, self.pos, k)
        self.values[layer].index_copy_(2, self.pos, v)
        return self.keys[layer], self.values[layer]

    def mask(self, layer: int, pos: Any, q_len: int) -> torch.Tensor:
        return self._mask
