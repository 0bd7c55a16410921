"""The linear-attention layers of a cache: a fixed-size state per layer instead of keys and values.

A gated DeltaNet layer (Qwen3-Next) keeps, whatever the sequence length, the last ``conv_kernel - 1`` inputs of
its causal convolution (``conv``, ``(B, channels, kernel - 1)`` in the cache's dtype) and its recurrent state
(``recurrent``, ``(B, value heads, key dim, value dim)`` in float32, as transformers keeps it). A step reads both
and replaces both in place: memory never grows, and nothing is written per position.

The state of position ``n`` cannot be recovered from the state of a later position, so a rewind of a state layer
(``truncate(n)`` for ``0 < n < length``) is refused; :meth:`kvexplore.Generator.rewind` then recomputes the kept
tokens in one pass (``needs_replay``). No earlier states are kept: a rewind costs one forward pass over the kept
sequence, and no memory. A write at position 0 (a new prompt) starts from zero state.
"""

from __future__ import annotations

import torch

from ..config.model_config import ModelConfig
from ..config.layer_plan import LayerSpec
from .layout import StateLayout
from .slots import SlotView


class StateLayers:
    def __init__(self, specs: list[LayerSpec], config: ModelConfig, batch_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        c = config
        self.conv = {s.index: torch.zeros(batch_size, c.conv_channels, c.conv_kernel - 1, dtype=dtype, device=device)
                     for s in specs}
        self.recurrent = {s.index: torch.zeros(batch_size, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim,
                                               dtype=torch.float32, device=device) for s in specs}

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv[layer], self.recurrent[layer]

    def write(self, owner, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Replace ``layer``'s state in place; ``owner`` (the cache) keeps the old one for a rollback and counts
        the bytes."""
        for old, new in ((self.conv[layer], conv), (self.recurrent[layer], recurrent)):
            owner._keep(old, 0, 0, old.shape[0])
            old.copy_(new)
            owner._step.written_bytes += old.nbytes

    def clear(self, owner) -> None:
        """Zero every state (a new sequence), keeping the old one for a rollback."""
        for t in (*self.conv.values(), *self.recurrent.values()):
            owner._keep(t, 0, 0, t.shape[0])
            t.zero_()

    def layer_bytes(self, layer: int) -> int:
        return self.conv[layer].nbytes + self.recurrent[layer].nbytes

    def reserved_bytes(self) -> int:
        return sum(self.layer_bytes(i) for i in self.conv)

    def slot_view(self, layer: int) -> SlotView:
        return SlotView([], [], [], StateLayout(conv_bytes=self.conv[layer].nbytes,
                                                recurrent_bytes=self.recurrent[layer].nbytes,
                                                shape=list(self.recurrent[layer].shape[1:])))

    def clone(self) -> "StateLayers":
        twin = object.__new__(StateLayers)
        twin.conv = {i: t.clone() for i, t in self.conv.items()}
        twin.recurrent = {i: t.clone() for i, t in self.recurrent.items()}
        return twin
