"""The state of a layer cache's physical slots: what the cache map draws."""

from __future__ import annotations

from dataclasses import dataclass, field

from .layout import Layout, LinearLayout

FREE, FILLED, STALE, EVICTED, SHARED = "free", "filled", "stale", "evicted", "shared"


@dataclass(frozen=True)
class SlotView:
    """The physical slots of one layer cache, in storage order.

    ``states[i]``: ``free`` (never written), ``filled`` (holds ``positions[i]``), ``stale`` (left behind by a
    rewind: written once, no longer part of the sequence), ``evicted`` (its position was dropped by the strategy),
    ``shared`` (filled and shared by ``sharers[i]`` > 1 sequences). ``positions[i]`` is -1 where no position is
    held. ``layout`` (a typed :class:`~kvexplore.caches.layout.Layout`) says how the slots are arranged: a page
    table, a ring and where it starts, a quantized part, a layer that shares another's cache.
    """

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


STATES = (FREE, FILLED, STALE, EVICTED, SHARED)  # the codes of PackedSlots.states
_CODE = {s: i for i, s in enumerate(STATES)}


@dataclass(frozen=True, eq=False)
class PackedSlots:
    """A :class:`SlotView` packed into arrays (a state code per slot, positions as int32, sharers as int16): about
    7 bytes a slot instead of three Python lists. :meth:`unpack` gives the view back, equal to the original."""

    states: "np.ndarray"
    positions: "np.ndarray"
    sharers: "np.ndarray"
    layout: Layout

    @classmethod
    def pack(cls, view: SlotView) -> "PackedSlots":
        import numpy as np

        return cls(np.fromiter((_CODE[s] for s in view.states), dtype=np.uint8, count=len(view.states)),
                   np.asarray(view.positions, dtype=np.int32), np.asarray(view.sharers, dtype=np.int16), view.layout)

    def unpack(self) -> SlotView:
        return SlotView([STATES[c] for c in self.states.tolist()], self.positions.tolist(), self.sharers.tolist(),
                        self.layout)

    @property
    def nbytes(self) -> int:
        return self.states.nbytes + self.positions.nbytes + self.sharers.nbytes
