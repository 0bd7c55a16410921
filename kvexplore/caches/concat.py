"""The classic Hugging Face cache: every write concatenates, allocating a larger tensor and copying the old one."""

from __future__ import annotations

import torch

from ..config.model_config import ModelConfig
from .base import FILLED, KVCache, SlotView
from .layout import GrowingLayout


class ConcatCache(KVCache):
    """Per layer ``k``/``v`` of shape ``[batch, kv_heads, length, head_dim]`` that grow by ``torch.cat``.

    Each write allocates new tensors one step longer and copies the whole cache into them (``copied_bytes`` of
    a step = the cache's size before it); the old storage is freed. A rewind slices a view, keeping the storage
    until the next write replaces it. Unbounded: it grows until memory runs out.
    """

    kind = "concat"

    def __init__(self, config: ModelConfig, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._k: list[torch.Tensor | None] = [None] * config.num_layers  # full layers only
        self._v: list[torch.Tensor | None] = [None] * config.num_layers

    def _write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        old_k, old_v = self._k[layer], self._v[layer]
        if old_k is not None and (pos < old_k.shape[2] or pos == 0):
            old_k, old_v = old_k.narrow(2, 0, pos), old_v.narrow(2, 0, pos)  # rewound: drop what is past pos
        step = self._step
        step.written_bytes += k.nbytes + v.nbytes
        if old_k is None or old_k.shape[2] == 0:
            new_k, new_v = k.contiguous().clone(), v.contiguous().clone()
        else:
            new_k, new_v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)  # allocate + copy all
            step.copied_bytes += old_k.nbytes + old_v.nbytes
        for old in (self._k[layer], self._v[layer]):
            if old is not None:
                step.frees += 1
                step.freed_bytes += old.untyped_storage().nbytes()
        step.allocations += 2
        step.allocated_bytes += new_k.nbytes + new_v.nbytes
        self._k[layer], self._v[layer] = new_k, new_v
        return new_k, new_v

    def _snapshot(self) -> dict:
        return {**super()._snapshot(), "_k": list(self._k), "_v": list(self._v)}  # writes replace, never modify

    def truncate(self, n: int) -> None:
        super().truncate(n)
        for i, (k, v) in enumerate(zip(self._k, self._v)):
            if k is not None:
                self._k[i], self._v[i] = k.narrow(2, 0, n), v.narrow(2, 0, n)  # views: storage kept

    def _storage(self, layer: int) -> list[torch.Tensor]:
        return [t for t in (self._k[layer], self._v[layer]) if t is not None]

    def key(self, layer: int) -> torch.Tensor | None:
        """The live key tensor of ``layer`` (``length`` positions), or None before the first write."""
        return self._k[layer]

    def value(self, layer: int) -> torch.Tensor | None:
        return self._v[layer]

    def _slot_view(self) -> SlotView:
        n = self.length
        return SlotView([FILLED] * n, list(range(n)), [1] * n, GrowingLayout())

    def _clone_storage(self, twin: "ConcatCache") -> None:
        twin._k = [None if t is None else t.clone() for t in self._k]
        twin._v = [None if t is None else t.clone() for t in self._v]

    @property
    def full_reserved_bytes(self) -> int:
        """Bytes of the storages held (after a rewind, the storage is still the pre-rewind size)."""
        return sum(t.untyped_storage().nbytes() for t in (*self._k, *self._v) if t is not None)
