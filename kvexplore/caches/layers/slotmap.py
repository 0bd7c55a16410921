"""What a layer whose slots are planned by a slot map shared with its cache's other layers has in common: its
storage is one key and one value tensor of a fixed number of slots, its slot view is the map's, and copies of the
cache's layers share one copy of the map (the rings' :class:`~kvexplore.caches.layers.sliding.SlidingLayers`, the sink
cache's :class:`~kvexplore.caches.layers.sink_layer.SinkSlots`)."""

from __future__ import annotations

from typing import Any

import torch

from ..layer import shallow_copy
from ..slots import SlotView


class SlotMapLayer:
    """A mixin for :class:`~kvexplore.caches.layer.StoredLayer` subclasses holding ``k``, ``v`` and ``slots`` (a shared
    map with ``slot_view(length)`` and ``copy()``); put it first among the bases."""

    k: torch.Tensor
    v: torch.Tensor
    slots: Any

    def storage(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def gather_with(self, counters, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """The keys and values of ``slots``, read before a write overwrites them, with the new ``k``/``v`` appended:
        what the queries of a write of several tokens read (temporaries, counted as copied and allocated)."""
        out = (torch.cat([self.k.index_select(2, slots), k.to(self.k.dtype)], 2),
               torch.cat([self.v.index_select(2, slots), v.to(self.v.dtype)], 2))
        n = out[0].nbytes + out[1].nbytes
        counters.temporaries(n, copied=n - k.nbytes - v.nbytes)
        return out

    def reserved_bytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def _slot_view(self, length: int) -> SlotView:
        return self.slots.slot_view(length)

    def clone(self, memo: dict[int, Any], fork: bool = False):
        twin = shallow_copy(self)
        if id(self.slots) not in memo:  # the layers' copies share one copy of the slot map
            memo[id(self.slots)] = self.slots.copy()
        twin.slots = memo[id(self.slots)]
        twin.k, twin.v = self.k.clone(), self.v.clone()
        return twin
