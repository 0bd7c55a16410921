"""A layer that stores nothing and reads an earlier layer's cache (Gemma 4's KV sharing)."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import SettingsError
from ..layer import Groups, LayerCache, Step, shallow_copy
from ..layout import SharedLayout
from ..slots import SlotView


class SharedLayer(LayerCache):
    """Reads what its source layer's attention read this step (``step.reads``); holds no storage of its own.
    ``source`` is the source layer's cache object (a reference, never copied by it)."""

    _crop_way = "stores nothing: it reads its source layer's cache, cut with it"

    def __init__(self, spec, source: LayerCache) -> None:
        super().__init__(spec)
        self.source = source

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise SettingsError(f"layer {self.spec.index} shares layer {self.spec.source}'s cache and stores nothing; "
                            f"read it with read_shared({self.spec.index})")

    def read(self, step: Step | None) -> tuple[torch.Tensor, torch.Tensor]:
        if step is None or self.spec.source not in step.reads:
            raise SettingsError(f"layer {self.spec.index} reads layer {self.spec.source}'s cache, which has not been "
                                f"written this step; run the layers in order")
        return step.reads[self.spec.source]

    def mask(self, step: Step) -> torch.Tensor | None:
        return self.source.mask(step)

    def groups(self) -> Groups:
        spec = self.spec  # it reads and draws as its source, under its source's mask
        return Groups((spec.attends, spec.source), (spec.kind, spec.source), self.source.groups().mask)

    def _held(self, length: int) -> int:
        return 0

    def _held_positions(self, length: int) -> list[int]:
        return []  # it reads its source's

    def _read_positions(self, length: int) -> list[int]:
        return self.source._read_positions(length)

    def _read_start(self) -> int:
        return self.source._read_start()

    def storage(self) -> list[torch.Tensor]:
        return self.source.storage()

    def _reserved_bytes(self) -> int:
        return 0

    def _used_bytes(self, length: int) -> int:
        return 0

    _analytic_bytes = _used_bytes

    def _slot_view(self, length: int) -> SlotView:
        return SlotView([], [], [], SharedLayout(self.spec.source))

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "SharedLayer":
        twin = shallow_copy(self, SharedLayer)
        twin.source = memo.get(id(self.source), self.source)  # the copy of the source (cloned before, in order)
        return twin

    def describe(self, count: int, strategy: str, config) -> str:
        return f"{count} shared layer{'s' * (count != 1)}: nothing stored (they read an earlier layer)"
