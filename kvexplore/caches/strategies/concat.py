"""The classic Hugging Face cache: every write concatenates, allocating a larger tensor and copying the old one."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ..base import KVCache
from ..options import Options
from ..layers.concat_layer import ConcatLayer


@dataclass(frozen=True)
class ConcatOptions(Options):
    """None: the storage grows with the sequence."""


class ConcatCache(KVCache):
    """Per full layer ``k``/``v`` of shape ``[batch, kv_heads, length, head_dim]`` that grow by ``torch.cat``
    (:class:`~kvexplore.caches.layers.concat_layer.ConcatLayer`). Each write allocates new tensors one step longer and
    copies the whole cache into them (``copied_bytes`` of a step = the cache's size before it); the old storage is
    freed. A rewind slices a view (storage kept until the next write). Unbounded: it grows until memory runs out."""

    kind = "concat"
    Options = ConcatOptions

    def __init__(self, config: ModelConfig, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._build()

    def full_layer(self, spec: LayerSpec) -> ConcatLayer:
        return ConcatLayer(spec, self.batch_size, self.dtype, self.device)

    def key(self, layer: int) -> torch.Tensor | None:
        """The live key tensor of ``layer`` (``length`` positions), or None before the first write."""
        return self.layers[layer].k if layer in self.full_layers else None

    def value(self, layer: int) -> torch.Tensor | None:
        return self.layers[layer].v if layer in self.full_layers else None
