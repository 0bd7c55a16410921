"""A layer that stores nothing: attention reads exactly what this pass computed (the "none" strategy's layers)."""

from __future__ import annotations

from typing import Any

import torch

from ..layer import LayerCache, Step, full_phrase
from ..layout import EmptyLayout
from ..masks import causal_mask
from ..slots import SlotView


class RecomputeLayer(LayerCache):
    """Keeps nothing between steps; the generator feeds the whole sequence every step. ``window``: the layer's
    attention reads only the last ``window`` positions (a sliding layer recomputed under its window mask)."""

    def __init__(self, spec, window: int | None = None) -> None:
        super().__init__(spec)
        self.window = window

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # nothing outlives the pass

    def mask(self, step: Step) -> torch.Tensor | None:
        return causal_mask(step.pos, step.q_len, self.window, step.device)

    def _held(self, length: int) -> int:
        return 0 if self.window is not None else length

    def _held_positions(self, length: int) -> list[int]:
        return [] if self.window is not None else list(range(length))

    def storage(self) -> list[torch.Tensor]:
        return []

    def _reserved_bytes(self) -> int:
        return 0

    def _used_bytes(self, length: int) -> int:
        return 0

    def _slot_view(self, length: int) -> SlotView:
        return SlotView([], [], [], EmptyLayout())

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "RecomputeLayer":
        return self  # holds nothing that changes

    def describe(self, count: int, strategy: str, config) -> str:
        if self.window is None:
            return full_phrase(self.spec, count, strategy, config)
        return f"{count} sliding layer{'s' * (count != 1)}: recomputed under a window of {self.window}"
