"""A full layer of the ``evict`` cache that really shrinks: each KV head's kept keys and values packed at the front of
its storage, the storage reallocated to what is kept after a press that frees slots.

Storage: ``k``/``v`` ``[batch, kv_heads, slots, width]``, ``pos`` and ``rot`` ``[batch, kv_heads, slots]`` (the position
each slot holds, -1 for none, and the position its key is rotated at), ``counts[b][h]`` slots in use; heads holding
different counts read ``max(counts)`` slots under a mask per head. A write appends in place, growing the storage by
``headroom`` slots when full. A press on storage already of the kept size moves the kept slots past the new count into
the evicted ones before it, in place, so slots no longer follow position order (the tail written since the last press
always does, which is what a rewind reads). docs/eviction.md has the bytes held."""

from __future__ import annotations

from typing import Any

import torch

from ..layer import Step, shallow_copy
from ..layout import CompactLayout
from ..memory import StepCounters
from ..slots import FILLED, FREE, SlotView
from .pressed import PressedLayer
from ...core import host


class CompactLayer(PressedLayer):
    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, plan, config,
                 headroom: int) -> None:
        super().__init__(spec, batch_size, dtype, device, plan, config)
        self.headroom = headroom
        self._alloc(0)
        self.counts = [[0] * spec.kv_heads for _ in range(batch_size)]
        self._mask: torch.Tensor | None = None
        self._read: torch.Tensor | None = None  # (B, H, S) the position in each column the last step's attention read

    def _alloc(self, slots: int) -> None:
        self.k, self.v = self.zeros(slots), self.zeros(slots, values=True)
        self.pos = torch.full(self.k.shape[:3], -1, dtype=torch.long, device=self.device)
        self.rot = self.pos.clone()

    def _state(self) -> tuple:
        return self.k, self.v, self.pos, self.rot, [list(c) for c in self.counts], self._mask, self._read

    def _set_state(self, saved: tuple) -> None:
        self.k, self.v, self.pos, self.rot, counts, self._mask, self._read = saved
        self.counts = [list(c) for c in counts]

    def begin(self, step: Step) -> None:
        super().begin(step)
        step.journal.remember(self._set_state, self._state())
        if step.pos < step.length:  # a write over positions held (after a rewind within the step): drop them
            self._keep_before(step.pos)

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def _grow(self, step: Step, need: int) -> None:
        """Room for ``need`` slots per head: new storage of ``need + headroom`` slots, the held ones copied."""
        old = (self.k, self.v, self.pos, self.rot)
        used = max(max(c) for c in self.counts)
        self._alloc(need + self.headroom)
        c = step.counters
        for new, t in zip((self.k, self.v, self.pos, self.rot), old):
            new.narrow(2, 0, used).copy_(t.narrow(2, 0, used))
        if self.acc is not None:
            self._resize_acc(self.slots)
        c.copied_bytes += old[0].narrow(2, 0, used).nbytes + old[1].narrow(2, 0, used).nbytes
        self._count_new_storage(c, old[0], old[1])

    def _count_new_storage(self, c: StepCounters, old_k: torch.Tensor, old_v: torch.Tensor) -> None:
        c.allocated_bytes += self.k.nbytes + self.v.nbytes
        c.freed_bytes += old_k.nbytes + old_v.nbytes
        c.allocations += 2
        c.frees += 2

    def _resize_acc(self, slots: int) -> None:
        B, H = self.k.shape[:2]
        acc = torch.zeros((B, H, max(slots, self.slots)), dtype=torch.float32, device=self.device)
        if self.acc is not None:
            n = min(self.acc.shape[2], acc.shape[2])
            acc[:, :, :n] = self.acc[:, :, :n]
        self.acc = acc

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T = k.shape[2]
        counts = self.counts
        low, top = min(min(c) for c in counts), max(max(c) for c in counts)
        if top + T > self.slots:  # new storage: a rollback puts the old tensors back (remembered in begin), no copy
            self._grow(step, top + T)
        else:
            for t in (self.k, self.v, self.pos, self.rot):  # what the step overwrites in place, for a rollback
                step.journal.keep(t, 2, low, top + T - low)
        step.counters.written_bytes += k.nbytes + v.nbytes
        positions = torch.arange(step.pos, step.end, device=self.device)
        uniform = low == top
        runs = [(slice(None), slice(None), top)] if uniform else [
            (b, h, counts[b][h]) for b in range(len(counts)) for h in range(len(counts[b]))]
        for b, h, n in runs:  # in place, at each head's count (one narrow for all when the counts agree)
            self.k[b, h, n:n + T] = k[b, h]
            self.v[b, h, n:n + T] = v[b, h]
            self.pos[b, h, n:n + T] = positions
            self.rot[b, h, n:n + T] = positions
        self.counts = [[n + T for n in row] for row in counts]
        S = top + T
        self._mask = self._make_mask(counts, T, S, step)
        # a press after the step moves the slots: keep what was read (as int32: positions fit, half the bytes)
        self._read = self.pos.narrow(2, 0, S).to(torch.int32)
        return self.k.narrow(2, 0, S), self.v.narrow(2, 0, S)

    def _make_mask(self, counts: list[list[int]], T: int, S: int, step: Step) -> torch.Tensor | None:
        """Slot ``j`` of head ``h`` is read by new token ``t`` when ``j < counts[h] + t + 1`` (held before the step,
        or written by the step at or before ``t``)."""
        flat = [n for row in counts for n in row]  # the counts live on the host: no device read to decide
        uniform = all(n == flat[0] for n in flat)
        if uniform and (T == 1 or step.pos == 0 and flat[0] == 0):
            return None  # every slot read (one token), or a plain causal prompt
        first = host.upload(counts, self.device)  # (B, H) slots held before the step
        j = torch.arange(S, device=self.device)
        t = torch.arange(T, device=self.device)
        allowed = j.view(1, 1, 1, S) < (first.view(*first.shape, 1, 1) + t.view(1, 1, T, 1) + 1)
        return allowed[0, 0] if uniform else allowed  # (T, S), or (B, H, T, S) per head

    def mask(self, step: Step) -> torch.Tensor | None:
        return self._mask

    def head_counts(self) -> torch.Tensor:
        return torch.tensor(self.counts)  # kept on the host

    def head_totals(self) -> tuple[int, int]:
        return sum(map(sum, self.counts)), max(map(max, self.counts))

    def held_slots(self):
        S = max(max(c) for c in self.counts)
        j = torch.arange(S, device=self.device)
        valid = j.view(1, 1, S) < host.upload(self.counts, self.device).unsqueeze(-1)
        return (self.k.narrow(2, 0, S), self.v.narrow(2, 0, S), valid, self.pos.narrow(2, 0, S),
                self.rot.narrow(2, 0, S))

    def keep(self, step: Step, keep: torch.Tensor, rot: torch.Tensor) -> None:
        """Gather each head's kept slots, in order, into new storage of ``max(kept) + headroom`` slots; or, when the
        storage already has that size (a press while decoding, keys not re-rotated), fill the evicted slots in
        place with the kept ones after them (:meth:`_fill_holes`)."""
        k, v, _, pos, was = self.held_slots()
        counts = keep.sum(-1)  # (B, H)
        top = int(counts.max())
        if not self.plan.rerotate and self.slots <= top + self.headroom:
            return self._fill_holes(step, keep, counts)
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :top]  # kept slots first
        filled = torch.arange(top, device=self.device).view(1, 1, top) < counts.unsqueeze(-1)

        def gather(t: torch.Tensor) -> torch.Tensor:
            return t.gather(2, order.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))

        new_k, new_v = gather(k), gather(v)
        new_pos, new_rot = pos.gather(-1, order), rot.gather(-1, order)
        if self.plan.rerotate:
            new_k = self.turn(new_k, was.gather(-1, order), new_rot)
        old_k, old_v, old_acc = self.k, self.v, self.acc
        self._alloc(top + self.headroom)
        self.k[:, :, :top] = new_k * filled.unsqueeze(-1)
        self.v[:, :, :top] = new_v * filled.unsqueeze(-1)
        self.pos[:, :, :top] = new_pos.masked_fill(~filled, -1)
        self.rot[:, :, :top] = new_rot.masked_fill(~filled, -1)
        if old_acc is not None:
            self.acc = torch.zeros(self.pos.shape, dtype=torch.float32, device=self.device)
            self.acc[:, :, :top] = old_acc[:, :, :k.shape[2]].gather(-1, order) * filled
        self.counts = counts.tolist()
        step.counters.copied_bytes += int(counts.sum()) * sum(self._widths) * self._dtype.itemsize
        self._count_new_storage(step.counters, old_k, old_v)
        self._mask = None

    def _fill_holes(self, step: Step, keep: torch.Tensor, counts: torch.Tensor) -> None:
        """Each head keeps ``counts`` slots: the evicted slots among its first ``counts`` (holes) take the kept slots
        past them (movers), pair by pair, in place; only the moved slots are copied (and saved for a rollback). The
        kept positions are then packed but no longer in position order."""
        S = keep.shape[2]
        front = torch.arange(S, device=self.device).view(1, 1, S) < counts.unsqueeze(-1)
        holes, movers = ~keep & front, keep & ~front  # as many of one as of the other, per head
        m = int(holes.sum(-1).max())
        if m:
            first = torch.arange(m, device=self.device).view(1, 1, m)
            paired = first < holes.sum(-1, keepdim=True)
            spare = torch.full_like(paired, self.slots - 1, dtype=torch.long)  # never a hole: a no-op pair
            dst = torch.where(paired, torch.sort((~holes).to(torch.uint8), dim=-1, stable=True).indices[..., :m], spare)
            src = torch.where(paired, torch.sort((~movers).to(torch.uint8), dim=-1, stable=True).indices[..., :m],
                              spare)
            for t in (self.k, self.v, self.pos, self.rot):
                d, s_ = (dst, src) if t.dim() == 3 else (dst.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]),
                                                        src.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))
                step.journal.keep_at(t, 2, d)
                t.scatter_(2, d, t.gather(2, s_))
            if self.acc is not None:  # a new tensor: the step's snapshot keeps the old one
                self.acc = self.acc.scatter(2, dst, self.acc.gather(2, src))
        if self.acc is not None:  # the slots past each head's count start again from nothing
            self.acc = torch.cat([self.acc[:, :, :S].masked_fill(~front, 0.0), self.acc[:, :, S:]], 2)
            moved = int(paired.sum())
            step.counters.copied_bytes += moved * sum(self._widths) * self._dtype.itemsize
        low = int(counts.min())
        step.journal.keep(self.pos, 2, low, S - low)
        self.pos[:, :, low:S].masked_fill_(~front[:, :, low:S], -1)  # slots past each head's count hold nothing
        self.counts = counts.tolist()
        self._mask = None

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        self._keep_before(n)
        self._read = None

    def _keep_before(self, n: int) -> None:
        """Hold only the positions before ``n`` (``n`` at or after the last press: they are each head's tail)."""
        self.counts = ((self.pos < n) & (self.pos >= 0)).sum(-1).tolist()

    def read_positions_by_head(self, length: int, batch: int = 0) -> list[list[int]]:
        """For each KV head, the position in each key column the last step's attention read (its slots in storage order,
        -1 where the head held nothing: a head that holds fewer than the most); after a rewind, the slots held."""
        read = self.held_slots()[3] if self._read is None else self._read
        return read[batch].tolist()

    def _read_positions(self, length: int) -> list[int]:
        """Head 0's :meth:`read_positions_by_head` (the columns are slots, and heads may hold other positions in
        them: a per-head view reads :meth:`read_positions_by_head`)."""
        return self.read_positions_by_head(length)[0]

    def storage(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def _reserved_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _slot_view(self, length: int, head: int = 0) -> SlotView:
        """Head ``head``'s slots (of the first sequence): kept positions packed at the front, then free slots."""
        n, S = self.counts[0][head], self.slots
        positions = self.pos[0, head, :n].tolist()
        return SlotView([FILLED] * n + [FREE] * (S - n), positions + [-1] * (S - n), [1] * n + [0] * (S - n),
                        CompactLayout())

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "CompactLayer":
        twin = shallow_copy(self, CompactLayer)
        twin.k, twin.v, twin.pos, twin.rot = (t.clone() for t in (self.k, self.v, self.pos, self.rot))
        twin.counts = [list(c) for c in self.counts]
        self._copy_press_state(twin, memo)
        return twin
