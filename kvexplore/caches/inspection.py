"""What a cache can say about itself, layer by layer: its storage, the positions each layer read, the state of every
physical slot, and its bytes (held, used, the formula). :class:`~.base.KVCache` inherits it; a strategy adds its
own ``_storage``, ``_slot_view``, ``full_reserved_bytes`` (and ``_read_positions`` when it evicts)."""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..core import host
from ..errors import SettingsError
from ..config.layer_plan import FULL, SHARED as SHARED_LAYER, SLIDING, STATE, LayerSpec, kinds_present
from .memory import LayerMemory, layer_bytes
from .layout import EmptyLayout, SharedLayout
from .slots import SlotView


class CacheInspection:
    """The read-only side of a cache (see the module docstring)."""

    # -- memory, layer by layer ----------------------------------------------------------------------------
    def layer_memory(self) -> list[LayerMemory]:
        """One :class:`LayerMemory` per layer, each from that layer's own storage and positions."""
        out = []
        for spec in self.plan:
            held = self.layer_held(spec.index)
            written, copied = self._layer_moved.get(spec.index, (0, 0))
            if spec.kind == SHARED_LAYER:
                logical = reserved = 0
            elif spec.kind == STATE:  # a fixed block, the same after every step
                logical = reserved = self.states.layer_bytes(spec.index)
            elif spec.kind == SLIDING and self.rings is not None:
                logical = layer_bytes(spec, held, self.batch_size, self.dtype)
                reserved = self.rings.layer_reserved(spec.index)
            elif spec.kind == SLIDING:  # nothing stored between steps
                logical = reserved = 0
            else:
                logical, reserved = self.full_layer_used(spec.index), self.full_layer_reserved(spec.index)
            analytic = self.config.state_bytes(self.batch_size, self.dtype.itemsize) if spec.kind == STATE else \
                layer_bytes(spec, held, self.batch_size, self.dtype)
            out.append(LayerMemory(spec.index, spec.kind, held, logical, reserved, analytic, written, copied))
        return out

    def layer_held(self, layer: int) -> int:
        """Positions ``layer`` holds: the strategy's for a full layer, the ring's for a sliding one, 0 shared."""
        spec = self.plan[layer]
        if spec.kind == SLIDING:
            return len(self.rings.held_positions(self.length)) if self.rings is not None else 0
        return 0 if spec.kind == SHARED_LAYER else self.held

    # -- inspection ----------------------------------------------------------------------------------------
    def _layer(self, layer: int | None) -> LayerSpec:
        """The spec of ``layer`` (None: the first full layer, or layer 0 when there is none)."""
        if layer is None:
            return self.plan[self.full_layers[0] if self.full_layers else 0]
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(self.plan):
            raise SettingsError(f"layer must be 0..{len(self.plan) - 1}, got {layer!r}")
        return self.plan[layer]

    def storage(self, layer: int) -> list[torch.Tensor]:
        """The tensors that hold ``layer``'s cache (a read that shares their memory is a view, not a copy); a
        shared layer's are its source's."""
        spec = self._layer(layer)
        if spec.kind == SHARED_LAYER:
            return self.storage(spec.source)
        if spec.kind == SLIDING:
            return [] if self.rings is None else [self.rings.k[layer], self.rings.v[layer]]
        if spec.kind == STATE:
            return list(self.states.read(layer))
        return self._storage(layer)

    def _storage(self, layer: int) -> list[torch.Tensor]:
        return []

    def read_positions(self, layer: int | None = None) -> list[int]:
        """The position of each key column ``layer``'s attention read in the last forward pass, in the order it
        saw them (default: a full layer's)."""
        spec = self._layer(layer)
        if spec.kind == SHARED_LAYER:
            return self.read_positions(spec.source)
        if spec.kind == STATE:
            return []  # no attention: the state summarises every position
        if spec.index in self._sparse_reads:
            if isinstance(self._sparse_reads[spec.index], torch.Tensor):  # still on the device: bring them all over
                pending = self.pending_reads()
                self.land_reads(dict(zip(pending, host.fetch(list(pending.values())))))
            return list(self._sparse_reads[spec.index])
        if spec.attends == SLIDING and self.rings is not None:
            return self.rings.read_positions(self.length)
        return self._read_positions()

    def _read_positions(self) -> list[int]:
        return list(range(self.length))

    def read_window(self, layer: int, count: int) -> tuple[int, int]:
        """``(first position, count)`` of what ``layer``'s attention reads in the step under way (``count`` keys):
        a sliding layer's ring reads its window, every other layer from position 0."""
        spec = self.plan[layer]
        if spec.attends == SLIDING and self.rings is not None and self.rings.plan is not None:
            return min(self.rings.plan.positions), count
        return 0, count

    def stored_error(self, layer: int) -> torch.Tensor | None:
        """How far what this cache stores for ``layer`` is from what the model wrote: ``(kv_heads, length)`` max
        absolute error per position, on the CPU, for the first sequence of the batch; None for a cache that stores
        keys and values exactly (every cache but the quantized one)."""
        return None

    def slot_view(self, layer: int | None = None) -> SlotView:
        """The state of every physical slot of ``layer`` (default: a full layer; what the cache map draws)."""
        spec = self._layer(layer)
        if spec.kind == SHARED_LAYER:
            return SlotView([], [], [], SharedLayout(spec.source))
        if spec.kind == STATE:
            return self.states.slot_view(spec.index)
        if spec.kind == SLIDING and self.rings is not None:
            return self.rings.slot_view(self.length)
        if spec.kind == SLIDING:
            return self._empty_view()
        return self._slot_view()

    def slot_views(self) -> list[SlotView]:
        """:meth:`slot_view` of every layer; layers that look the same share one object (one per kind)."""
        by_kind: dict[tuple[str, int], SlotView] = {}
        out = []
        for spec in self.plan:
            key = (spec.kind, spec.source if spec.kind == SHARED_LAYER else -1)
            if key not in by_kind:
                by_kind[key] = self.slot_view(spec.index)
            out.append(by_kind[key])
        return out

    def _empty_view(self) -> SlotView:
        return SlotView([], [], [], EmptyLayout())

    @abstractmethod
    def _slot_view(self) -> SlotView:
        """The strategy's slots (the same for every full layer)."""

    @property
    @abstractmethod
    def full_reserved_bytes(self) -> int:
        """Bytes of the strategy's storage for the full layers, used or not."""

    @property
    def reserved_bytes(self) -> int:
        """Bytes of storage the cache holds now, used or not: the strategy's plus the sliding layers' rings."""
        return (self.full_reserved_bytes + (0 if self.rings is None else self.rings.reserved_bytes())
                + (0 if self.states is None else self.states.reserved_bytes()))

    def full_layer_reserved(self, layer: int) -> int:
        """Bytes of one full layer's storage (its storages, each counted once)."""
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self._storage(layer)}
        return sum(seen.values())

    def full_layer_used(self, layer: int) -> int:
        """Bytes of one full layer's slots that hold valid positions."""
        return layer_bytes(self.plan[layer], self.held, self.batch_size, self.dtype)

    @property
    def held(self) -> int:
        """Positions a full layer holds (``length``, unless the strategy evicts)."""
        return self.length

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots that hold valid positions, summed over layers."""
        return sum(m.logical_bytes for m in self.layer_memory())

    @property
    def analytic_bytes(self) -> int:
        """The formula for what the cache holds: ``2 * kv_heads * head_dim * element_size * batch * held`` summed
        over the layers that store their own cache."""
        return sum(m.analytic_bytes for m in self.layer_memory())

    def describe_layers(self) -> str:
        """What the cache keeps for each kind of layer, in one line."""
        parts = []
        for kind in kinds_present(self.plan):
            n = sum(1 for s in self.plan if s.kind == kind)
            if kind == FULL:
                spec = self.plan[self.full_layers[0]]
                index = self.config.index_head_dim if self.config.index_topk else 0
                what = f" (latent {spec.head_dim} + rope key {spec.value_width - index}" + (
                    f" + indexer key {index}" if index else "") + " per position)" if spec.latent else ""
                parts.append(f"{n} full layer{'s' * (n != 1)}{what}: {self.kind}")
            elif kind == SLIDING:
                what = f"a ring of {self.rings.window} slots each" if self.rings is not None else \
                    f"recomputed under a window of {self.config.sliding_window}"
                parts.append(f"{n} sliding layer{'s' * (n != 1)}: {what}")
            elif kind == STATE:
                size = self.states.layer_bytes(next(s.index for s in self.plan if s.kind == STATE))
                parts.append(f"{n} linear-attention layer{'s' * (n != 1)}: a fixed state of {size} B each")
            else:
                parts.append(f"{n} shared layer{'s' * (n != 1)}: nothing stored (they read an earlier layer)")
        return "; ".join(parts)
