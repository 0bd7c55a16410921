"""No cache at all: every step recomputes keys and values for the whole sequence."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ..base import KVCache
from ..options import Options
from ..layers.recompute import RecomputeLayer


@dataclass(frozen=True)
class NoOptions(Options):
    """None: the storage holds nothing."""


class NoCache(KVCache):
    """Keeps nothing. Its length stays 0, so the generator feeds the entire sequence at position 0 every step:
    the cost of a step grows with the sequence (this is what "disabling the cache" means)."""

    kind = "none"
    Options = NoOptions
    stores = False  # sliding layers recompute under their window mask like the others

    def __init__(self, config: ModelConfig, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._build()

    def full_layer(self, spec: LayerSpec) -> RecomputeLayer:
        return RecomputeLayer(spec)  # attention reads exactly what this pass computed; nothing outlives it

    def commit(self, end: int) -> None:
        super().commit(0)  # nothing is kept (the length stays 0), but the step wrote: its report counts it

    def fork(self) -> "NoCache":
        return self.clone()  # nothing is held, so there is nothing to share: any time is a fine time to fork
