"""The sliding-window layers of a cache: one ring of ``window`` slots per layer, written round and round.

A query at ``p`` reads keys ``p - window < k <= p`` (transformers' convention), so position ``p`` lives in slot
``p % window``, evicting ``p - window``. Each step is planned once for every sliding layer by the one
:class:`SlidingLayers` they share (:meth:`SlidingLayers._plan`): before the ring wraps, a causal view of its start;
one new token over a full window, the whole storage as it lies (no mask, no copy); otherwise the held positions the
queries need gathered and the new keys appended, under a sliding mask (a counted copy). A rewind to ``n`` is
possible while the ring still holds ``n - window + 1 .. n - 1`` (docs/strategies.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layer import Step, shallow_copy
from ..layout import RingLayout
from ..masks import causal_mask, positions_mask
from ..slots import EVICTED, FILLED, FREE, STALE, SlotView
from ...core import host


@dataclass
class RingPlan:
    """How one step reads and writes the rings (computed once, used by every sliding layer)."""

    pos: int
    end: int
    read: int | torch.Tensor | None  # int: read narrow(2, 0, read); None: read all slots; tensor: gather these slots
    mask: torch.Tensor | None
    positions: list[int]  # the position of each key column attention reads


class SlidingLayers:
    """The slot bookkeeping every sliding layer of one cache shares: the window, which position each slot holds,
    this step's plan and what the last step read. The tensors live in the layers (:class:`RingLayer`)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.slot_pos = [-1] * window  # position last written to each slot (-1: never)
        self.plan: RingPlan | None = None
        self.last_read: list[int] | None = None  # the positions the last step's attention read
        self._step: int | None = None  # the serial of the step planned (each layer asks; the first one plans)

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

    def begin(self, step: Step) -> None:
        """Plan ``step`` (once, whichever layer asks first) and record how to undo its bookkeeping."""
        if (self._step == step.serial and self.plan is not None
                and (self.plan.pos, self.plan.end) == (step.pos, step.end)):
            return
        if self._step != step.serial:
            step.journal.remember(self._restore, (list(self.slot_pos), self.last_read))
        self._step = step.serial
        self.plan = self._plan(step.pos, step.q_len, step.device)

    def _restore(self, saved: tuple[list[int], list[int] | None]) -> None:
        self.slot_pos, self.last_read = list(saved[0]), saved[1]
        self.plan, self._step = None, None

    def _plan(self, pos: int, q_len: int, device: torch.device) -> RingPlan:
        W, end = self.window, pos + q_len
        if end <= W:
            return RingPlan(pos, end, end, causal_mask(pos, q_len, None, device), list(range(end)))
        before = range(max(0, pos - W + 1), pos)
        if q_len == 1 and all(self.holds(p) for p in before):
            positions = list(self.slot_pos)
            positions[pos % W] = pos
            return RingPlan(pos, end, None, None, positions)
        slots = host.upload([p % W for p in before], device, torch.long)
        k_pos = [*before, *range(pos, end)]
        mask = positions_mask(torch.arange(pos, end, device=device), host.upload(k_pos, device), W)
        return RingPlan(pos, end, slots, mask, k_pos)

    def commit(self, step: Step) -> None:
        """Once per step: the slots written now hold the step's positions."""
        if self.plan is not None and self._step == step.serial:
            for p in range(max(self.plan.pos, self.plan.end - self.window), self.plan.end):
                self.slot_pos[p % self.window] = p
            self.last_read = self.plan.positions
        self.plan = None

    def read_positions(self, length: int) -> list[int]:
        """Positions of the key columns the last step read (after a rewind: the positions held)."""
        if self.plan is not None:
            return list(self.plan.positions)
        return list(self.last_read) if self.last_read is not None else self.held_positions(length)

    def forget_reads(self) -> None:
        """After a rewind: no step has read anything since."""
        self.last_read, self.plan, self._step = None, None, None

    def slot_view(self, length: int) -> SlotView:
        W = self.window
        lo = max(0, length - W)
        slots = []  # (state, position, sharers) of every slot
        for p in self.slot_pos:
            held = lo <= p < length
            state = FILLED if held else FREE if p < 0 else STALE if p >= length else EVICTED
            slots.append((state, p if held else -1, int(held)))
        states, positions, sharers = map(list, zip(*slots))
        held = self.held_positions(length)
        layout = RingLayout(sinks=0, window=W, ring_start=held[0] % W if held else 0, write_slot=length % W,
                            evicted=lo)
        return SlotView(states, positions, sharers, layout)

    def copy(self) -> "SlidingLayers":
        twin = shallow_copy(self, SlidingLayers)
        twin.slot_pos, twin.plan, twin._step = list(self.slot_pos), None, None
        return twin

