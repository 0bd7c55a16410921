"""No cache at all: every step recomputes keys and values for the whole sequence."""

from __future__ import annotations

import torch

from ..config.model_config import ModelConfig
from .base import KVCache, SlotView


class NoCache(KVCache):
    """Keeps nothing. Its length stays 0, so the generator feeds the entire sequence at position 0 every step:
    the cost of a step grows with the sequence (this is what "disabling the cache" means)."""

    kind = "none"
    rings_for_sliding = False  # sliding layers recompute under their window mask like the others

    def __init__(self, config: ModelConfig, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")

    def _write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v  # attention reads exactly what this pass computed; nothing outlives it

    def commit(self, end: int) -> None:
        self._report = self._make_report()  # nothing is kept (the length stays 0), but the step wrote

    def _slot_view(self) -> SlotView:
        return self._empty_view()  # no storage: nothing survives a step

    def fork(self) -> "NoCache":
        return self.clone()  # nothing is held, so there is nothing to share: any time is a fine time to fork

    def _clone_storage(self, twin: "NoCache") -> None:
        pass

    @property
    def full_reserved_bytes(self) -> int:
        return 0
