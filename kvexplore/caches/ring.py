"""The sliding-window layers of a cache: one ring of ``window`` slots per layer, written round and round.

A sliding layer's query at position ``p`` reads only keys ``p - window < k <= p`` (transformers' convention), so
the layer never needs more than the last ``window`` positions: position ``p`` lives in slot ``p % window`` and
writing it overwrites (evicts) position ``p - window``. Memory is flat however long the sequence grows.

What attention reads, per step (the same for every sliding layer, planned once):

- nothing has wrapped yet (``pos + q_len <= window``): slots ``0..end-1`` hold positions ``0..end-1``; attention
  reads the view ``narrow(2, 0, end)`` with the ordinary causal mask;
- one new token and the ring holds the window before it: after the write the ring holds exactly positions
  ``p - window + 1 .. p``, so attention reads the whole storage in storage order (a view, no mask);
- otherwise (a prompt longer than the window, a chunk that wraps, a write after a rewind): the positions the new
  queries need that the ring holds are gathered in position order and the new keys appended (a temporary copy,
  counted), with a sliding-window mask; then the last ``window`` new positions are written into the ring.

A rewind to ``n`` is possible while the ring still holds every position the next query needs
(``n - window + 1 .. n - 1``): one step back always, further only before the ring has wrapped past them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.layer_plan import LayerSpec
from .slots import EVICTED, FILLED, FREE, STALE, SlotView
from .layout import RingLayout
from .masks import causal_mask, positions_mask


@dataclass
class RingPlan:
    """How one step reads and writes the rings (computed once, used by every sliding layer)."""

    pos: int
    end: int
    read: int | torch.Tensor | None  # int: read narrow(2, 0, read); None: read all slots; tensor: gather these slots
    mask: torch.Tensor | None
    positions: list[int]  # the position of each key column attention reads


class SlidingLayers:
    """The rings of every sliding layer of one cache (they share the window and the slot bookkeeping)."""

    def __init__(self, specs: list[LayerSpec], batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.window = specs[0].window
        self.specs = {s.index: s for s in specs}
        self.k = {s.index: torch.zeros(batch_size, s.kv_heads, self.window, s.head_dim, dtype=dtype, device=device)
                  for s in specs}
        self.v = {s.index: torch.zeros(batch_size, s.kv_heads, self.window, s.value_width, dtype=dtype, device=device)
                  for s in specs}
        self.slot_pos = [-1] * self.window  # position last written to each slot (-1: never)
        self.plan: RingPlan | None = None
        self.last_read: list[int] | None = None  # the positions the last step's attention read

    # -- positions -----------------------------------------------------------------------------------------
    def holds(self, p: int) -> bool:
        return self.slot_pos[p % self.window] == p

    def held_positions(self, length: int) -> list[int]:
        """Positions of the sequence (of ``length``) the rings hold, oldest first."""
        return [p for p in range(max(0, length - self.window), length) if self.holds(p)]

    def rewind_error(self, n: int, length: int) -> str | None:
        """Why the rings cannot go back to ``n`` positions (None when they can)."""
        if n >= length:
            return None
        lost = [p for p in range(max(0, n - self.window + 1), n) if not self.holds(p)]
        if not lost:
            return None
        return (f"the sliding-window layers (window {self.window}) no longer hold position {lost[-1]}, which a "
                f"query at position {n} reads (it was overwritten by position {lost[-1] + self.window}); rewind to "
                f"{length - 1} or later, or start again from the prompt")

    # -- a step --------------------------------------------------------------------------------------------
    def begin(self) -> None:
        self.plan = None

    def _plan(self, pos: int, q_len: int, device: torch.device) -> RingPlan:
        W, end = self.window, pos + q_len
        if end <= W:
            return RingPlan(pos, end, end, causal_mask(pos, q_len, None, device), list(range(end)))
        before = range(max(0, pos - W + 1), pos)
        if q_len == 1 and all(self.holds(p) for p in before):
            positions = list(self.slot_pos)
            positions[pos % W] = pos
            return RingPlan(pos, end, None, None, positions)
        slots = torch.tensor([p % W for p in before], dtype=torch.long, device=device)
        k_pos = [*before, *range(pos, end)]
        mask = positions_mask(torch.arange(pos, end, device=device), torch.tensor(k_pos, device=device), W)
        return RingPlan(pos, end, slots, mask, k_pos)

    def write(self, owner, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` of ``layer`` and return what its attention reads; ``owner`` (the cache) counts the
        bytes and keeps what a rollback needs."""
        W, q_len = self.window, k.shape[2]
        if self.plan is None:
            self.plan = self._plan(pos, q_len, k.device)
        plan, rk, rv = self.plan, self.k[layer], self.v[layer]
        step = owner._step
        gathered = None
        if isinstance(plan.read, torch.Tensor):  # gather what the queries need before the write overwrites it
            gathered = (torch.cat([rk.index_select(2, plan.read), k.to(rk.dtype)], 2),
                        torch.cat([rv.index_select(2, plan.read), v.to(rv.dtype)], 2))
            n = gathered[0].nbytes + gathered[1].nbytes
            step.copied_bytes += n - k.nbytes - v.nbytes
            step.allocated_bytes += n
            step.freed_bytes += n
            step.allocations += 2
            step.frees += 2
        first = max(pos, plan.end - W)  # only the last `window` new positions are kept
        p = first
        while p < plan.end:  # runs of slots up to the end of the ring, then from slot 0
            start = p % W
            count, offset = min(plan.end - p, W - start), p - pos
            p += count
            owner._keep(rk, 2, start, count)  # what the slots held (an evicted position), for a rollback
            owner._keep(rv, 2, start, count)
            rk.narrow(2, start, count).copy_(k.narrow(2, offset, count))  # in place: no allocation
            rv.narrow(2, start, count).copy_(v.narrow(2, offset, count))
            step.written_bytes += k.narrow(2, offset, count).nbytes + v.narrow(2, offset, count).nbytes
        if gathered is not None:
            return gathered
        if plan.read is None:
            return rk, rv  # every slot, in storage order: a view
        return rk.narrow(2, 0, plan.read), rv.narrow(2, 0, plan.read)

    def commit(self) -> None:
        if self.plan is not None:
            for p in range(max(self.plan.pos, self.plan.end - self.window), self.plan.end):
                self.slot_pos[p % self.window] = p
            self.last_read = self.plan.positions
        self.plan = None

    def read_positions(self, length: int) -> list[int]:
        """Positions of the key columns the last step read (after a rewind: the positions held)."""
        if self.plan is not None:
            return list(self.plan.positions)
        return list(self.last_read) if self.last_read is not None else self.held_positions(length)

    def snapshot(self) -> tuple[list[int], list[int] | None]:
        return list(self.slot_pos), self.last_read

    def restore(self, saved: tuple[list[int], list[int] | None]) -> None:
        self.slot_pos, self.last_read = list(saved[0]), saved[1]
        self.plan = None

    # -- inspection ----------------------------------------------------------------------------------------
    def slot_view(self, length: int) -> SlotView:
        W = self.window
        lo = max(0, length - W)
        states, positions, sharers = [], [], []
        for p in self.slot_pos:
            held = lo <= p < length
            states.append(FILLED if held else FREE if p < 0 else STALE if p >= length else EVICTED)
            positions.append(p if held else -1)
            sharers.append(1 if held else 0)
        held = self.held_positions(length)
        layout = RingLayout(sinks=0, window=W, ring_start=held[0] % W if held else 0, write_slot=length % W,
                            evicted=lo)
        return SlotView(states, positions, sharers, layout)

    def reserved_bytes(self) -> int:
        return sum(t.nbytes for t in (*self.k.values(), *self.v.values()))

    def layer_reserved(self, layer: int) -> int:
        return self.k[layer].nbytes + self.v[layer].nbytes

    def clone(self) -> "SlidingLayers":
        twin = object.__new__(SlidingLayers)
        twin.__dict__.update(self.__dict__)
        twin.k = {i: t.clone() for i, t in self.k.items()}
        twin.v = {i: t.clone() for i, t in self.v.items()}
        twin.slot_pos, twin.plan = list(self.slot_pos), None
        return twin

