"""A full layer of the StreamingLLM sink cache, and the eviction bookkeeping its layers share (see :mod:`..sink`)."""

from __future__ import annotations

import torch

from .slotmap import SlotMapLayer
from ..layer import FullLayer, Step, shallow_copy
from ..layout import RingLayout
from ..memory import StepCounters
from ..slots import EVICTED, FILLED, FREE, STALE, SlotView
from ...core import host


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
        self._step: int | None = None  # the serial of the step planned (not the step: its journal is not ours to keep)
        self.gather: torch.Tensor | None = None  # slots read before a write of several tokens that evicts
        self.mask_now: torch.Tensor | None = None  # that write's mask over the gathered keys and the new ones
        self.read_now: list[int] = []  # the positions of its key columns
        self.last_read: list[int] | None = None  # the positions the last such step read (None: the held slots)

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
        if self._step == step.serial and self.pending is not None and self.pending[:2] == (step.pos, step.end):
            return
        if self._step != step.serial:
            step.journal.remember(self._restore, (list(self.slot_pos), self.ws, list(self.evicted_last),
                                                  self.last_read))
        self._step = step.serial
        pos, end = step.pos, step.end
        ws_before = self.sinks if pos <= self.sinks else self.ws
        ws_after = max(ws_before, end - self.window)
        self.gather, self.mask_now = None, None
        if ws_after > self.sinks and end - pos > 1:  # several tokens that evict: read what the queries need first
            before = [*range(min(pos, self.sinks)), *range(max(ws_before, self.sinks), pos)]
            self.gather = host.upload([self.slot(p) for p in before], self.device, torch.long)
            k_pos = host.upload([*before, *range(pos, end)], self.device)
            q_pos = torch.arange(pos, end, device=self.device)
            first = torch.clamp(q_pos - self.window + 1, min=ws_before)  # the first window position each query reads
            self.mask_now = (k_pos[None, :] <= q_pos[:, None]) & (
                (k_pos[None, :] < self.sinks) | (k_pos[None, :] >= first[:, None]))
            self.read_now = [*before, *range(pos, end)]
        for p in range(pos, end):
            self.slot_pos[self.slot(p)] = p
        if self.gather is not None:
            read = None
        elif ws_after == self.sinks:
            read = end  # nothing evicted: slots 0..end-1 hold positions 0..end-1
        elif end - ws_after == self.window:
            read = self.sinks + self.window  # every slot held: the whole storage
        else:  # window not full after a rewind into it: only some ring slots are held
            read = host.upload(self.held_slots(end, ws_after), self.device)
        self.pending = (pos, end, ws_before, ws_after, read)

    def runs(self, pos: int, end: int, ws_after: int) -> list[tuple[int, int, int]]:
        """Where a write of ``pos..end-1`` goes: ``(slot, offset in the write, count)`` runs of contiguous slots, for
        the positions kept after it (sinks, and the window from ``ws_after``), each slot written once."""
        out = []
        if pos < self.sinks:
            out.append((pos, 0, min(end, self.sinks) - pos))
        p = max(pos, ws_after, self.sinks)
        while p < end:
            slot = self.slot(p)
            count = min(end - p, self.sinks + self.window - slot)
            out.append((slot, p - pos, count))
            p += count
        return out

    def _restore(self, saved: tuple) -> None:
        slot_pos, self.ws, evicted, self.last_read = saved
        self.slot_pos, self.evicted_last = list(slot_pos), list(evicted)
        self.pending, self._step, self.gather, self.mask_now = None, None, None, None

    def commit(self, step: Step) -> None:
        if self._step != step.serial:  # committed already (every layer commits; the first one does it)
            return
        if self.pending is not None:
            _, _, ws_before, ws_after, _ = self.pending
            self.evicted_last = list(range(ws_before, ws_after))
            self.ws = ws_after
        else:
            self.evicted_last = []
        self.last_read = self.read_now if self.gather is not None else None
        self.pending, self._step, self.gather, self.mask_now = None, None, None, None

    def truncate(self, n: int) -> None:
        if self.pending is not None:  # truncated mid-step (a failed step rolls back instead): overwritten = lost
            self.ws = max(self.ws, self.pending[3])
            self.pending = None
        if n <= self.sinks:
            self.ws = self.sinks
        self.evicted_last, self._step, self.last_read = [], None, None

    def slot_view(self, length: int) -> SlotView:
        slots = []  # (state, position, sharers) of every slot
        for p in self.slot_pos:
            held = 0 <= p < length and (p < self.sinks or p >= self.ws)
            state = FILLED if held else FREE if p < 0 else EVICTED if self.sinks <= p < self.ws else STALE
            slots.append((state, p if held else -1, int(held)))
        states, positions, sharers = map(list, zip(*slots))
        layout = RingLayout(sinks=self.sinks, window=self.window, ring_start=self.slot(self.ws),
                            write_slot=self.slot(length), evicted=self.ws - self.sinks)
        return SlotView(states, positions, sharers, layout)

    def copy(self) -> "SinkSlots":
        twin = shallow_copy(self, SinkSlots)
        twin.slot_pos, twin.evicted_last = list(self.slot_pos), list(self.evicted_last)
        twin.pending, twin._step, twin.gather, twin.mask_now = None, None, None, None
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
        slots = self.slots
        if slots.pending is None or slots._step != step.serial:
            slots.begin(step)
        pos, end, _, ws_after, read = slots.pending
        c, journal = step.counters, step.journal
        gathered = None
        if slots.gather is not None:  # what the queries need, read before the write overwrites it
            gathered = self.gather_with(c, slots.gather, k, v)
        for slot, offset, count in slots.runs(pos, end, ws_after):
            journal.keep(self.k, 2, slot, count)  # what the slots held (an evicted position): for a rollback
            journal.keep(self.v, 2, slot, count)
            self.k.narrow(2, slot, count).copy_(k.narrow(2, offset, count))  # in place: no allocation
            self.v.narrow(2, slot, count).copy_(v.narrow(2, offset, count))
            c.written_bytes += k.narrow(2, offset, count).nbytes + v.narrow(2, offset, count).nbytes
        if gathered is not None:
            return gathered
        if isinstance(read, int):
            return self.k.narrow(2, 0, read), self.v.narrow(2, 0, read)  # views
        k_all, v_all = self.k.index_select(2, read), self.v.index_select(2, read)
        c.temporaries(k_all.nbytes + v_all.nbytes)  # dropped after the layer's attention
        return k_all, v_all

    def mask(self, step: Step) -> torch.Tensor | None:
        slots = self.slots
        if slots.pending is None or slots._step != step.serial:
            slots.begin(step)
        if slots.mask_now is not None:
            return slots.mask_now
        return super().mask(step)

    def commit(self, step: Step) -> None:
        self.slots.commit(step)

    _crop_way = ("a draft that evicted positions the kept sequence still holds is rolled back (the journal puts the "
                "overwritten slots back) and the accepted tokens are written again; otherwise its slots are left stale")

    def _truncate_error(self, n: int, length: int) -> str | None:
        return self.slots.rewind_error(n)

    def _crop_error(self, n: int, length: int) -> str | None:
        slots = self.slots
        keeps = max(slots.ws - len(slots.evicted_last), n - slots.window)  # the window start had it stopped at n
        if n < length and slots.ws > max(keeps, slots.sinks):
            return (f"the draft evicted positions {max(keeps, slots.sinks)}..{slots.ws - 1}, which the kept sequence "
                    f"still holds")
        return None  # else its truncate answer

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        self.slots.truncate(n)

    def _held(self, length: int) -> int:
        return self.slots.held(length)

    def _held_positions(self, length: int) -> list[int]:
        return sorted(self.slots.held_positions(length))

    def _read_positions(self, length: int) -> list[int]:
        slots = self.slots
        if slots.gather is not None:
            return list(slots.read_now)
        if slots.last_read is not None:
            return list(slots.last_read)
        return slots.held_positions(length)  # write() returns the held slots in storage order
