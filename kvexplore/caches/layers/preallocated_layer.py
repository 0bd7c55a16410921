"""A full layer allocated once and written in place (the exllama-style strategy's layer)."""

from __future__ import annotations

from typing import Any

import torch

from ..layer import FullLayer, Step, shallow_copy
from ..slots import FILLED, FREE, STALE, SlotView


class PreallocatedLayer(FullLayer):
    """``k``/``v`` of ``[batch, kv_heads, capacity, width]``: a write is ``k.narrow(2, pos, q_len).copy_(k_new)``
    and attention reads the view ``k.narrow(2, 0, pos + q_len)``. Nothing is reallocated or copied."""

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, capacity: int) -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.capacity = capacity
        self.k, self.v = self.zeros(capacity), self.zeros(capacity, values=True)
        self.high_water = 0  # slots below this were written at some point (stale if past the length)

    def prepare(self, step: Step, pos: int, q_len: int) -> int:
        """What a write of ``q_len`` slots at ``pos`` needs besides the copy: slots written before are kept for an
        undo, slots never written are zeroed again on undo (no copy, so a decode step allocates nothing). Returns
        the bytes it writes (counted in the step)."""
        seen = max(0, min(q_len, self.high_water - pos))
        journal = step.journal
        for t in (self.k, self.v):
            journal.keep(t, 2, pos, seen)
            journal.zero_on_undo(t, 2, pos + seen, q_len - seen)
        written = self.k.narrow(2, pos, q_len).nbytes + self.v.narrow(2, pos, q_len).nbytes
        step.counters.written_bytes += written
        return written

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos, q_len = step.pos, k.shape[2]
        self.prepare(step, pos, q_len)
        self.k.narrow(2, pos, q_len).copy_(k)  # in place: no allocation
        self.v.narrow(2, pos, q_len).copy_(v)
        return self.k.narrow(2, 0, pos + q_len), self.v.narrow(2, 0, pos + q_len)  # views

    def commit(self, step: Step) -> None:
        if step.end > self.high_water:
            step.journal.remember(self._set_high_water, self.high_water)
            self.high_water = step.end

    def _set_high_water(self, value: int) -> None:
        self.high_water = value

    def storage(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def _reserved_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _slot_view(self, length: int) -> SlotView:
        n, hw, cap = length, self.high_water, self.capacity
        states = [FILLED] * n + [STALE] * (hw - n) + [FREE] * (cap - hw)
        return SlotView(states, list(range(n)) + [-1] * (cap - n), [1] * n + [0] * (cap - n))

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "PreallocatedLayer":
        twin = shallow_copy(self)
        twin.k, twin.v = self.k.clone(), self.v.clone()
        return twin
