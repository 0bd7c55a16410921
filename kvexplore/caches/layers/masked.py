"""A full layer of the ``evict`` cache that keeps everything and hides what a press evicted (kvpress's head-wise presses
work this way): the same kept set as the compacting layer, with no memory freed, to show the difference.

Storage: ``k``/``v`` ``[batch, kv_heads, capacity, width]`` allocated once, position ``p`` in slot ``p`` (as the
pre-allocated cache); ``visible`` ``[batch, kv_heads, capacity]`` says which positions each head still reads, and
``rot`` the position each key is rotated at. Attention reads ``narrow(2, 0, end)`` under a mask per head. A press
changes ``visible`` (and, re-rotating, turns the kept keys in place); nothing is freed or moved."""

from __future__ import annotations

from typing import Any

import torch

from ..layer import Step, shallow_copy
from ..masks import causal_mask
from ..memory import StepCounters
from ..slots import EVICTED, FILLED, FREE, SlotView
from .pressed import PressedLayer
from ...core import host


class MaskedLayer(PressedLayer):
    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, plan, config,
                 capacity: int) -> None:
        super().__init__(spec, batch_size, dtype, device, plan, config)
        self.capacity = capacity
        self.k, self.v = self.zeros(capacity), self.zeros(capacity, values=True)
        self.visible = torch.zeros(self.k.shape[:3], dtype=torch.bool, device=device)
        self.rot = torch.arange(capacity, device=device).expand(self.k.shape[:3]).clone()
        self.end = 0  # positions written
        self.evicted = False  # whether a press hid anything (else plain causal attention is exact)
        # on the host: what each head kept below the last press's length (every position written since is held)
        self._kept: torch.Tensor | None = None
        self._kept_upto = 0
        self._mask: torch.Tensor | None = None

    def begin(self, step: Step) -> None:
        super().begin(step)
        step.journal.remember(self._set_state, (self.end, self.evicted, self._mask, self._kept, self._kept_upto))

    def _set_state(self, saved: tuple) -> None:
        self.end, self.evicted, self._mask, self._kept, self._kept_upto = saved

    def head_counts(self) -> torch.Tensor:
        if self._kept is None or self.end < self._kept_upto:
            return super().head_counts()
        return self._kept + (self.end - self._kept_upto)

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos, T = step.pos, k.shape[2]
        for t in (self.k, self.v, self.visible, self.rot):
            step.journal.keep(t, 2, pos, T)
        self.k.narrow(2, pos, T).copy_(k)
        self.v.narrow(2, pos, T).copy_(v)
        self.visible[:, :, pos:pos + T] = True
        self.rot[:, :, pos:pos + T] = torch.arange(pos, pos + T, device=self.device)
        step.counters.written_bytes += k.nbytes + v.nbytes
        self.end = step.end
        if not self.evicted:
            self._mask = causal_mask(pos, T, None, self.device)
        else:  # (B, H, T, end): what each head still reads, and causal among the new tokens
            cols = torch.arange(step.end, device=self.device)
            causal = cols.view(1, -1) <= torch.arange(pos, step.end, device=self.device).view(-1, 1)
            self._mask = self.visible[:, :, None, :step.end] & causal
        return self.k.narrow(2, 0, step.end), self.v.narrow(2, 0, step.end)

    def mask(self, step: Step) -> torch.Tensor | None:
        return self._mask

    def _read_positions(self, length: int) -> list[int]:
        """Every position written: attention reads them all from memory, the evicted under the mask."""
        return list(range(self.end))

    def held_slots(self):
        S = self.end
        pos = torch.arange(S, device=self.device).expand(self.visible.shape[0], self.visible.shape[1], S)
        return (self.k.narrow(2, 0, S), self.v.narrow(2, 0, S), self.visible[:, :, :S], pos,
                self.rot[:, :, :S])

    def _resize_acc(self, slots: int) -> None:
        if self.acc is None:
            self.acc = torch.zeros(self.visible.shape, dtype=torch.float32, device=self.device)

    def keep(self, step: Step, keep: torch.Tensor, rot: torch.Tensor) -> None:
        S = keep.shape[2]
        step.journal.keep(self.visible, 2, 0, S)
        self.visible[:, :, :S] = keep
        if self.plan.rerotate:  # turn the kept keys in place (the old keys kept for a rollback)
            step.journal.keep(self.k, 2, 0, S)
            step.journal.keep(self.rot, 2, 0, S)
            k = self.k.narrow(2, 0, S)
            k.copy_(torch.where(keep.unsqueeze(-1), self.turn(k, self.rot[:, :, :S], rot), k))
            self.rot[:, :, :S] = torch.where(keep, rot, self.rot[:, :, :S])
        self.evicted = True
        self._mask = None
        (self._kept,) = host.fetch([keep.sum(-1)])
        self._kept_upto = S

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        self.end = min(self.end, n)

    def storage(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def _reserved_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _slot_view(self, length: int, head: int = 0) -> SlotView:
        """Head ``head``'s slots (of the first sequence): slot p holds position p, kept or evicted (hidden)."""
        seen = self.visible[0, head, :length].tolist()
        n = min(length, self.end)
        states = [FILLED if seen[p] else EVICTED for p in range(n)] + [FREE] * (self.capacity - n)
        positions = [p if seen[p] else -1 for p in range(n)] + [-1] * (self.capacity - n)
        return SlotView(states, positions, [1 if seen[p] else 0 for p in range(n)] + [0] * (self.capacity - n))

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "MaskedLayer":
        twin = shallow_copy(self, MaskedLayer)
        twin.k, twin.v, twin.visible, twin.rot = (t.clone() for t in (self.k, self.v, self.visible, self.rot))
        self._copy_press_state(twin, memo)
        return twin
