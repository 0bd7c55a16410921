"""The exllama-style cache: one key and one value tensor per layer, allocated once, written in place."""

from __future__ import annotations

import torch

from ..config.model_config import ModelConfig
from ..core.settings import positive_int
from ..errors import CacheFullError
from .memory import full_layer_bytes
from .base import FILLED, FREE, STALE, KVCache, SlotView


class PreallocatedCache(KVCache):
    """Per layer ``k``/``v`` of shape ``[batch, kv_heads, max_seq_len, head_dim]``, allocated up front.

    A write is ``k.narrow(2, pos, q_len).copy_(k_new)``; attention reads the view ``k.narrow(2, 0, pos + q_len)``.
    Nothing is ever reallocated or copied, so memory is fixed at ``reserved_bytes`` from the start.
    """

    kind = "preallocated"

    def __init__(self, config: ModelConfig, max_seq_len: int, batch_size: int = 1,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> None:
        max_seq_len = positive_int(max_seq_len, "max_seq_len")
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._k = self._per_full_layer(lambda i: torch.zeros(self._full_shape(i, max_seq_len), dtype=self.dtype,
                                                             device=self.device))
        self._v = self._per_full_layer(lambda i: torch.zeros(self._full_shape(i, max_seq_len, values=True),
                                                             dtype=self.dtype, device=self.device))
        self._capacity = max_seq_len
        self._high_water = 0  # slots below this were written at some point (stale if past the length)

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        super().check_write(pos, q_len, batch_size)
        if pos + q_len > self.capacity:
            raise CacheFullError(used=pos, needed=q_len, capacity=self.capacity)

    def _write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_len = k.shape[2]
        self._prepare_write(layer, pos, q_len)
        self._k[layer].narrow(2, pos, q_len).copy_(k)  # in place: no allocation
        self._v[layer].narrow(2, pos, q_len).copy_(v)
        return self._k[layer].narrow(2, 0, pos + q_len), self._v[layer].narrow(2, 0, pos + q_len)  # views

    def _prepare_write(self, layer: int, pos: int, q_len: int) -> int:
        """What a write of ``q_len`` slots at ``pos`` needs besides the copy: what a rollback restores, and the bytes
        it writes (returned). Slots written before (held, or stale after a rewind) are saved; slots never written
        hold zeros, which a rollback puts back without a copy (so a plain decode step allocates nothing)."""
        seen = max(0, min(q_len, self._high_water - pos))
        for t in (self._k[layer], self._v[layer]):
            self._keep(t, 2, pos, seen)
            self._zero_on_undo(t, 2, pos + seen, q_len - seen)
        written = sum(t.narrow(2, pos, q_len).nbytes for t in (self._k[layer], self._v[layer]))
        self._step.written_bytes += written
        return written

    def note_inplace_write(self, pos: int, q_len: int) -> None:
        """Every layer's write of ``q_len`` slots at ``pos``, made by someone else (the compiled decode step writes
        the storages itself): the undo record and the bytes, as :meth:`write` keeps them. Call it after
        ``begin_step`` and before the storages change; ``commit`` follows."""
        for layer in self.full_layers:
            self._layer_moved[layer] = (self._prepare_write(layer, pos, q_len), 0)

    def commit(self, end: int) -> None:
        self._high_water = max(self._high_water, end)
        super().commit(end)

    def _snapshot(self) -> dict:
        return {**super()._snapshot(), "_high_water": self._high_water}

    def _slot_view(self) -> SlotView:
        n, hw = self.length, self._high_water
        states = [FILLED] * n + [STALE] * (hw - n) + [FREE] * (self.capacity - hw)
        positions = list(range(n)) + [-1] * (self.capacity - n)
        return SlotView(states, positions, [1] * n + [0] * (self.capacity - n))

    def _storage(self, layer: int) -> list[torch.Tensor]:
        return [self._k[layer], self._v[layer]]

    def key(self, layer: int) -> torch.Tensor:
        """The live key storage of ``layer``, all ``capacity`` slots (slots past ``length`` are stale or zero)."""
        return self._k[layer]

    def value(self, layer: int) -> torch.Tensor:
        """The live value storage of ``layer``, all ``capacity`` slots."""
        return self._v[layer]

    def _clone_storage(self, twin: "PreallocatedCache") -> None:
        twin._k = [None if t is None else t.clone() for t in self._k]
        twin._v = [None if t is None else t.clone() for t in self._v]

    @property
    def full_reserved_bytes(self) -> int:
        return full_layer_bytes(self.config, self.capacity, self.batch_size, self.dtype)
