"""The state of a layer cache's physical slots: what the cache map draws."""

from __future__ import annotations

from dataclasses import dataclass, field

from .layout import Layout, LinearLayout

FREE, FILLED, STALE, EVICTED, SHARED = "free", "filled", "stale", "evicted", "shared"


@dataclass(frozen=True)
class SlotView:
    """The physical slots of one layer cache, in storage order. ``states[i]``: ``free`` (never written), ``filled``
    (holds ``positions[i]``), ``stale`` (left behind by a rewind: written once, no longer part of the sequence),
    ``evicted`` (its position was dropped by the strategy), ``shared`` (filled and shared by ``sharers[i]`` > 1
    sequences). ``positions[i]`` is -1 where no position is held. ``layout`` (a typed
    :class:`~kvexplore.caches.layout.Layout`) says how the slots are arranged: a page table, a ring and where it starts,
    a quantized part, a layer that shares another's cache."""

    states: list[str]
    positions: list[int]
    sharers: list[int]
    layout: Layout = field(default_factory=LinearLayout)

    def __post_init__(self) -> None:
        if not len(self.states) == len(self.positions) == len(self.sharers):
            raise AssertionError("slot view lists differ in length")

    def count(self, state: str) -> int:
        return self.states.count(state)

    @property
    def held(self) -> int:
        """Slots that hold a position of the sequence (filled or shared): the map's and the status's figure."""
        return self.states.count(FILLED) + self.states.count(SHARED)
