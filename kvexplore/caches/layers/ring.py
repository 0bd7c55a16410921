"""A sliding layer's ring: ``window`` slots of keys and values, with the slot map shared by every sliding layer."""

from __future__ import annotations

import torch

from .slotmap import SlotMapLayer
from ..layer import StoredLayer, Step
from .sliding import SlidingLayers
from ..memory import StepCounters


class RingLayer(SlotMapLayer, StoredLayer):
    """``k``/``v`` of ``[batch, kv_heads, window, width]``; position ``p`` in slot ``p % window``. ``slots`` is the
    :class:`~kvexplore.caches.layers.sliding.SlidingLayers` every sliding layer of the cache shares."""

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device,
                 slots: SlidingLayers) -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.slots = slots
        self.k, self.v = self.zeros(slots.window), self.zeros(slots.window, values=True)

    def begin(self, step: Step) -> None:
        self.slots.begin(step)

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.slots
        slots.begin(step)  # planned once per step: the first layer that asks plans, the others find it done
        W, plan, rk, rv, pos = slots.window, slots.plan, self.k, self.v, step.pos
        c, journal = step.counters, step.journal
        gathered = None
        if isinstance(plan.read, torch.Tensor):  # gather what the queries need before the write overwrites it
            gathered = self.gather_with(c, plan.read, k, v)
        p = max(pos, plan.end - W)  # only the last `window` new positions are kept
        while p < plan.end:  # runs of slots up to the end of the ring, then from slot 0
            start = p % W
            count, offset = min(plan.end - p, W - start), p - pos
            p += count
            journal.keep(rk, 2, start, count)  # what the slots held (an evicted position), for a rollback
            journal.keep(rv, 2, start, count)
            rk.narrow(2, start, count).copy_(k.narrow(2, offset, count))  # in place: no allocation
            rv.narrow(2, start, count).copy_(v.narrow(2, offset, count))
            c.written_bytes += k.narrow(2, offset, count).nbytes + v.narrow(2, offset, count).nbytes
        if gathered is not None:
            return gathered
        if plan.read is None:
            return rk, rv  # every slot, in storage order: a view
        return rk.narrow(2, 0, plan.read), rv.narrow(2, 0, plan.read)

    def mask(self, step: Step) -> torch.Tensor | None:
        self.slots.begin(step)
        return self.slots.plan.mask

    def commit(self, step: Step) -> None:
        self.slots.commit(step)

    def _replay_error(self, n: int, length: int) -> str | None:
        return self.slots.rewind_error(n, length)

    _crop_way = ("a draft that wrapped the ring over positions the kept sequence still reads is rolled back (the "
                "journal puts those slots back) and the accepted tokens are written again; otherwise its slots are "
                "left stale")

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        self.slots.forget_reads()

    def _held(self, length: int) -> int:
        return len(self.slots.held_positions(length))

    def _held_positions(self, length: int) -> list[int]:
        return self.slots.held_positions(length)

    def _read_positions(self, length: int) -> list[int]:
        return self.slots.read_positions(length)

    def _read_start(self) -> int:
        plan = self.slots.plan
        return 0 if plan is None else min(plan.positions)

    def describe(self, count: int, strategy: str, config) -> str:
        return f"{count} sliding layer{'s' * (count != 1)}: a ring of {self.slots.window} slots each"
