"""The exllama-style cache: one key and one value tensor per full layer, allocated once, written in place."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ..base import KVCache
from ..options import Options, option, positive
from ..layers.preallocated_layer import PreallocatedLayer


@dataclass(frozen=True)
class PreallocatedOptions(Options):
    max_seq_len: int = option(help="positions each layer holds, allocated up front", check=positive, flag=None)


class PreallocatedCache(KVCache):
    """Per full layer ``k``/``v`` of shape ``[batch, kv_heads, max_seq_len, head_dim]``, allocated up front
    (:class:`~kvexplore.caches.layers.preallocated_layer.PreallocatedLayer`). A write is ``k.narrow(2, pos,
    q_len).copy_(k_new)``; attention reads the view ``k.narrow(2, 0, pos + q_len)``. Nothing is ever reallocated or
    copied, so memory is fixed at ``reserved_bytes`` from the start."""

    kind = "preallocated"
    Options = PreallocatedOptions

    def __init__(self, config: ModelConfig, max_seq_len: int, batch_size: int = 1,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> None:
        self.options = self.Options(max_seq_len)
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._capacity = self.options.max_seq_len
        self._build()

    def full_layer(self, spec: LayerSpec) -> PreallocatedLayer:
        return PreallocatedLayer(spec, self.batch_size, self.dtype, self.device, self._capacity)

    def note_inplace_write(self, pos: int, q_len: int) -> None:
        """Every layer's write of ``q_len`` slots at ``pos``, made by someone else (the compiled decode step writes
        the storages itself): the undo record and the bytes, as :meth:`write` keeps them. Call it after
        ``begin_step`` and before the storages change; ``commit`` follows."""
        step = self._step_for(pos, q_len)
        for layer in self.full_layers:
            self.book.moved[layer] = (self.layers[layer].prepare(step, pos, q_len), 0)

    def key(self, layer: int) -> torch.Tensor | None:
        """The live key storage of ``layer``, all ``capacity`` slots (slots past ``length`` are stale or zero);
        None for a layer the strategy does not serve."""
        return self.layers[layer].k if layer in self.full_layers else None

    def value(self, layer: int) -> torch.Tensor | None:
        """The live value storage of ``layer``, all ``capacity`` slots."""
        return self.layers[layer].v if layer in self.full_layers else None

    # what notebooks/07's planted bugs subclass: the storages by layer (None for the layers it does not serve) and
    # the slots written at some point
    @property
    def _k(self) -> list[torch.Tensor | None]:
        return [self.key(i) for i in range(len(self.layers))]

    @property
    def _v(self) -> list[torch.Tensor | None]:
        return [self.value(i) for i in range(len(self.layers))]

    @property
    def _high_water(self) -> int:
        return self.layers[self.full_layers[0]].high_water if self.full_layers else 0
