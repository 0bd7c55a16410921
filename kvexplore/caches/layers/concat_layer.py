"""A full layer that grows by concatenation (the classic Hugging Face cache's layer)."""

from __future__ import annotations

from typing import Any

import torch

from ..layer import FullLayer, Step, shallow_copy
from ..layout import GrowingLayout
from ..memory import StepCounters
from ..slots import FILLED, SlotView


class ConcatLayer(FullLayer):
    """``k``/``v`` of ``[batch, kv_heads, length, width]``: every write allocates tensors one step longer and
    copies the old ones into them; a rewind slices a view (the storage stays until the next write)."""

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def begin(self, step: Step) -> None:
        step.journal.remember(self._restore, (self.k, self.v))  # a write replaces the tensors, never modifies

    def _restore(self, saved: tuple) -> None:
        self.k, self.v = saved

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = step.pos
        old_k, old_v = self.k, self.v
        if old_k is not None and (pos < old_k.shape[2] or pos == 0):
            old_k, old_v = old_k.narrow(2, 0, pos), old_v.narrow(2, 0, pos)  # rewound: drop what is past pos
        c = step.counters
        c.written_bytes += k.nbytes + v.nbytes
        if old_k is None or old_k.shape[2] == 0:
            new_k, new_v = k.contiguous().clone(), v.contiguous().clone()
        else:
            new_k, new_v = torch.cat([old_k, k], dim=2), torch.cat([old_v, v], dim=2)  # allocate + copy all
            c.copied_bytes += old_k.nbytes + old_v.nbytes
        for old in (self.k, self.v):
            if old is not None:
                c.frees += 1
                c.freed_bytes += old.untyped_storage().nbytes()
        c.allocations += 2
        c.allocated_bytes += new_k.nbytes + new_v.nbytes
        self.k, self.v = new_k, new_v
        return new_k, new_v

    _crop_way = "the keys and values are narrowed to the kept length (a view: the storage is kept, nothing copied)"

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        if self.k is not None:
            self.k, self.v = self.k.narrow(2, 0, n), self.v.narrow(2, 0, n)  # views: storage kept

    def storage(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v) if t is not None]

    def _slot_view(self, length: int) -> SlotView:
        return SlotView([FILLED] * length, list(range(length)), [1] * length, GrowingLayout())

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "ConcatLayer":
        twin = shallow_copy(self, ConcatLayer)
        twin.k, twin.v = (None if t is None else t.clone() for t in (self.k, self.v))
        return twin
