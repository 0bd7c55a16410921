"""A full layer of the StreamingLLM sink cache, and the eviction bookkeeping its layers share (see :mod:`..sink`)."""

from __future__ import annotations

import torch

from .slotmap import SlotMapLayer
from ..layer import FullLayer, Step
from ..layout import RingLayout
from ..memory import StepCounters
from ..slots import EVICTED, FILLED, FREE, STALE, SlotView


class SinkSlots:
    """What every full layer of one sink cache shares: ``sinks`` fixed slots, a ring of ``window`` slots after
    them, the first window position held (``ws``; ``sinks .. ws - 1`` were evicted), the position each slot holds,
    and this step's plan (made once, in ``begin_step``). The layers' tensors live in :class:`SinkLayer`."""

    def __init__(self, sinks: int, window: int, device: torch.device) -> None:
        self.sinks, self.window, self.device = sinks, window, device
        self.ws = sinks
        self.slot_pos = [-1] * (sinks + window)  # position last written to each slot (-1: never)
        self.pending: tuple | None = None  # (pos, end, ws_before, ws_after, read) of the step being written
        self.evicted_last: list[int] = []
        self._step: Step | None = None

    def slot(self, p: int) -> int:
        return p if p < self.sinks else self.sinks + (p - self.sinks) % self.window

    def held_slots(self, end: int, ws: int) -> list[int]:
        return sorted([*range(min(end, self.sinks)), *(self.slot(p) for p in range(ws, end))])

    def held(self, length: int) -> int:
        return min(length, self.sinks) + max(0, length - self.ws)

    def held_positions(self, length: int) -> list[int]:
        return [self.slot_pos[s] for s in self.held_slots(length, self.ws)]

    def rewind_error(self, n: int) -> str | None:
        if n <= self.sinks or n >= self.ws:
            return None
        return (f"cannot rewind to {n}: positions {self.sinks}..{self.ws - 1} were evicted (the window starts at "
                f"position {self.ws}); rewind to {self.ws} or later, or to {self.sinks} or earlier (sinks only)")

    def begin(self, step: Step) -> None:
        """Once per step (whichever layer asks first): the slot bookkeeping and what attention reads."""
        if self._step is step and self.pending is not None and self.pending[:2] == (step.pos, step.end):
            return
        if self._step is not step:
            step.journal.remember(self._restore, (list(self.slot_pos), self.ws, list(self.evicted_last)))
        self._step = step
        pos, end = step.pos, step.end
        ws_before = self.sinks if pos <= self.sinks else self.ws
        ws_after = max(ws_before, end - self.window)
        for p in range(pos, end):
            self.slot_pos[self.slot(p)] = p
        if ws_after == self.sinks:
            read = end  # nothing evicted: slots 0..end-1 hold positions 0..end-1
        elif end - ws_after == self.window:
            read = self.sinks + self.window  # every slot held: the whole storage
        else:  # window not full after a rewind into it: only some ring slots are held
            read = torch.tensor(self.held_slots(end, ws_after), device=self.device)
        self.pending = (pos, end, ws_before, ws_after, read)

    def _restore(self, saved: tuple) -> None:
        slot_pos, self.ws, evicted = saved
        self.slot_pos, self.evicted_last = list(slot_pos), list(evicted)
        self.pending, self._step = None, None

    def commit(self, step: Step) -> None:
        if self._step is not step:  # committed already (every layer commits; the first one does it)
            return
        if self.pending is not None:
            _, _, ws_before, ws_after, _ = self.pending
            self.evicted_last = list(range(ws_before, ws_after))
            self.ws = ws_after
        else:
            self.evicted_last = []
        self.pending, self._step = None, None

    def truncate(self, n: int) -> None:
        if self.pending is not None:  # truncated mid-step (a failed step rolls back instead): overwritten = lost
            self.ws = max(self.ws, self.pending[3])
            self.pending = None
        if n <= self.sinks:
            self.ws = self.sinks
        self.evicted_last, self._step = [], None

    def slot_view(self, length: int) -> SlotView:
        states, positions, sharers = [], [], []
        for p in self.slot_pos:
            held = 0 <= p < length and (p < self.sinks or p >= self.ws)
            state = FILLED if held else FREE if p < 0 else EVICTED if self.sinks <= p < self.ws else STALE
            states.append(state)
            positions.append(p if held else -1)
            sharers.append(1 if held else 0)
        layout = RingLayout(sinks=self.sinks, window=self.window, ring_start=self.slot(self.ws),
                            write_slot=self.slot(length), evicted=self.ws - self.sinks)
        return SlotView(states, positions, sharers, layout)

    def copy(self) -> "SinkSlots":
        twin = object.__new__(SinkSlots)
        twin.__dict__.update(self.__dict__)
        twin.slot_pos, twin.evicted_last, twin.pending, twin._step = list(self.slot_pos), list(self.evicted_last), \
            None, None
        return twin


class SinkLayer(SlotMapLayer, FullLayer):
    """``k``/``v`` of ``[batch, kv_heads, sinks + window, width]``, allocated once; ``slots`` the shared
    :class:`SinkSlots`. A write goes in place; attention reads the held slots in storage order."""

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, slots: SinkSlots) -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.slots = slots
        n = slots.sinks + slots.window
        self.k, self.v = self.zeros(n), self.zeros(n, values=True)

    def begin(self, step: Step) -> None:
        self.slots.begin(step)

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots, q_len = self.slots, k.shape[2]
        if slots.pending is None or slots._step is not step:
            slots.begin(step)
        read = slots.pending[4]
        slot = slots.slot(step.pos)  # a write of several tokens never wraps (check_write): its slots are contiguous
        step.journal.keep(self.k, 2, slot, q_len)  # what the slots held (an evicted position): for a rollback
        step.journal.keep(self.v, 2, slot, q_len)
        self.k.narrow(2, slot, q_len).copy_(k)  # in place: no allocation
        self.v.narrow(2, slot, q_len).copy_(v)
        c = step.counters
        c.written_bytes += k.nbytes + v.nbytes
        if isinstance(read, int):
            return self.k.narrow(2, 0, read), self.v.narrow(2, 0, read)  # views
        k_all, v_all = self.k.index_select(2, read), self.v.index_select(2, read)
        c.copied_bytes += k_all.nbytes + v_all.nbytes  # temporaries, dropped after the layer's attention
        c.allocated_bytes += k_all.nbytes + v_all.nbytes
        c.freed_bytes += k_all.nbytes + v_all.nbytes
        c.allocations += 2
        c.frees += 2
        return k_all, v_all

    def commit(self, step: Step) -> None:
        self.slots.commit(step)

    def truncate_error(self, n: int, length: int) -> str | None:
        return self.slots.rewind_error(n)

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        self.slots.truncate(n)

    def held(self, length: int) -> int:
        return self.slots.held(length)

    def held_positions(self, length: int) -> list[int]:
        return sorted(self.slots.held_positions(length))

    def read_positions(self, length: int) -> list[int]:
        return self.slots.held_positions(length)  # write() returns the held slots in storage order
