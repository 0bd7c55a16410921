"""What a cache can say about itself, layer by layer: its storage, the positions each layer read, the state of every
physical slot, and its bytes: the memory report of each step (used, reserved, the formula, and held: every tensor
storage reachable from the cache, by part, see :mod:`.held`). :class:`~.base.KVCache` inherits it; every answer comes
from the layer's own :class:`~kvexplore.caches.layer.LayerCache` object."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from ..config.layer_plan import LayerSpec, layers_by_kind
from ..core import host
from ..errors import SettingsError
from .held import PLAIN, THIS_STEP, UNDO_SCRATCH, StorageWalk
from .memory import LayerMemory, MemoryReport
from .slots import SlotView


class CacheInspection:
    """The read-only side of a cache (see the module docstring)."""

    # -- memory, layer by layer ----------------------------------------------------------------------------
    def layer_memory(self, walk: StorageWalk | None = None) -> list[LayerMemory]:
        """One :class:`LayerMemory` per layer, each from that layer's own storage and positions; ``walk``: a
        :meth:`held_walk` whose per-layer figures fill ``held_bytes`` and ``parts``."""
        moved, n = self._layer_moved, self.length
        if walk is None:
            return [layer.memory(n, *moved.get(i, (0, 0))) for i, layer in enumerate(self.layers)]
        return [layer.memory(n, *moved.get(i, (0, 0)), held_bytes=sum(parts.values()), parts=parts)
                for i, (layer, parts) in enumerate(zip(self.layers, walk.layer_parts))]

    #: the container's attributes that are not held memory of their own (the layers are walked one by one; the
    #: step's journal, reads and masks are counted apart; the rest holds no tensor)
    _NOT_WALKED = frozenset({"layers", "_journal", "_cur", "_scratch", "_saved", "_masks", "config", "plan",
                             "_report", "allocator", "_window"})

    def held_walk(self) -> StorageWalk:
        """Every tensor storage reachable from this cache, each counted once, by part (see :mod:`.held`):
        ``walk.parts`` (the step's part under :data:`~.held.THIS_STEP`), ``walk.layer_parts`` (per layer)."""
        walk = StorageWalk()
        layer_parts: list[dict[str, int]] = [{} for _ in self.layers]
        for parts, layer in zip(layer_parts, self.layers):
            name = layer.stored_name
            if got := sum(walk.add_tensor(name, t) for t in layer.storage()):
                parts[name] = got
        shared = []  # each layer's own tensors first, then what it shares (a plan, a page table)
        for parts, layer in zip(layer_parts, self.layers):
            for name, value in vars(layer).items():
                cls = type(value)
                if cls in PLAIN:
                    continue  # nothing held
                if cls is not torch.Tensor:
                    shared.append((parts, layer, name, value))
                elif got := walk.add_tensor(label := _label(layer, name), value):
                    parts[label] = parts.get(label, 0) + got
        for parts, layer, name, value in shared:
            if got := walk.add(label := _label(layer, name), value):
                parts[label] = parts.get(label, 0) + got
        walk.walked(*self.layers)  # every layer's attributes were walked above, one by one
        for name, value in vars(self).items():
            if name not in self._NOT_WALKED and type(value) not in PLAIN:
                walk.add(name.lstrip("_"), value)
        journal = self._journal  # the step under way: what its journal keeps for the next step is held already
        if journal is not None:
            walk.add(UNDO_SCRATCH, journal.kept_scratch())
        walk.add(THIS_STEP, journal, self._cur, self._saved, self._masks, self._scratch if journal else None)
        walk.add(UNDO_SCRATCH, self._scratch)
        walk.layer_parts = layer_parts
        return walk

    def memory_report(self) -> MemoryReport:
        """Memory after the last forward pass (its writes, copies and allocations) or after a rewind."""
        if self._report is None:
            self._report = self._make_report()
        return self._report

    def _make_report(self) -> MemoryReport:
        s, walk = self._counters, self.held_walk()
        layers = self.layer_memory(walk)
        held = dict(walk.parts)
        step = held.pop(THIS_STEP, 0)
        return MemoryReport(
            length=self.length, logical_bytes=sum(m.logical_bytes for m in layers),
            reserved_bytes=self.reserved_bytes, analytic_bytes=sum(m.analytic_bytes for m in layers),
            written_bytes=s.written_bytes, copied_bytes=s.copied_bytes, allocated_bytes=s.allocated_bytes,
            freed_bytes=s.freed_bytes, allocations=s.allocations, frees=s.frees, cuda=self._window.figures(),
            cuda_now=self.allocator.now() if self.allocator is not None else {}, layers=tuple(layers),
            held_bytes=sum(held.values()), held=held, step_bytes=step)

    def _copy_report_to(self, twin: "CacheInspection") -> None:
        """Give ``twin`` (a copy of this cache) its own report: settle() adds to a report's allocator figures."""
        if self._report is not None:
            twin._report = replace(self._report, cuda=dict(self._report.cuda))
            twin._held_again(walk=True)

    def _held_again(self, walk: bool = False) -> None:
        """The step was let go: the report's held figures lose what only the step held and count the undo scratch
        as it is now (trimmed), the rest unchanged since the report was made; ``walk``: count everything again
        (a rollback restores the report of before the step, and the step's masks are gone)."""
        report = self._report
        if report is not None and walk:
            fresh = self._make_report()
            if (fresh.held, fresh.step_bytes, fresh.layers) != (report.held, report.step_bytes, report.layers):
                self._report = replace(report, layers=fresh.layers, held=fresh.held, held_bytes=fresh.held_bytes,
                                       step_bytes=fresh.step_bytes)
        elif report is not None:
            held = dict(report.held)
            scratch = sum(t.untyped_storage().nbytes() for pool in self._scratch.values() for t in pool)
            before = held.pop(UNDO_SCRATCH, 0)
            if scratch:
                held[UNDO_SCRATCH] = scratch
            self._report = replace(report, held=held, held_bytes=report.held_bytes - before + scratch, step_bytes=0)

    def layer_held(self, layer: int) -> int:
        """Positions ``layer`` holds: the strategy's for a full layer, the ring's for a sliding one, 0 shared."""
        return self.layers[layer].held(self.length)

    def held_positions_of(self, layer: int) -> list[int]:
        """The positions ``layer`` holds, oldest first (a shared or a recurrent layer: none of its own)."""
        return self.layers[self._layer(layer).index].held_positions(self.length)

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
        return self.layers[self._layer(layer).index].storage()

    def read_positions(self, layer: int | None = None) -> list[int]:
        """The position of each key column ``layer``'s attention read in the last forward pass, in the order it
        saw them (default: a full layer's)."""
        spec = self._layer(layer)
        if spec.index in self._sparse_reads:
            if isinstance(self._sparse_reads[spec.index], torch.Tensor):  # still on the device: bring them all over
                pending = self.pending_reads()
                self.land_reads(dict(zip(pending, host.fetch(list(pending.values())))))
            return list(self._sparse_reads[spec.index])
        return self.layers[spec.index].read_positions(self.length)

    def read_window(self, layer: int, count: int) -> tuple[int, int]:
        """``(first position, count)`` of what ``layer``'s attention reads in the step under way (``count`` keys):
        a sliding layer's ring reads its window, every other layer from position 0."""
        return self.layers[layer].read_start(), count

    def slot_view(self, layer: int | None = None) -> SlotView:
        """The state of every physical slot of ``layer`` (default: a full layer; what the cache map draws)."""
        return self.layers[self._layer(layer).index].slot_view(self.length)

    def slot_views(self) -> list[SlotView]:
        """:meth:`slot_view` of every layer; layers that look the same share one object (one per kind)."""
        seen: dict[tuple, SlotView] = {}
        out = []
        for layer in self.layers:
            key = layer.view_key()
            if key not in seen:
                seen[key] = layer.slot_view(self.length)
            out.append(seen[key])
        return out

    @property
    def reserved_bytes(self) -> int:
        """Bytes of storage the cache holds now, used or not: every layer's."""
        return sum(layer.reserved_bytes() for layer in self.layers)

    @property
    def full_reserved_bytes(self) -> int:
        """Bytes of the strategy's storage for the full layers, used or not."""
        return sum(self.layers[i].reserved_bytes() for i in self.full_layers)

    @property
    def held(self) -> int:
        """Positions a full layer holds (``length``, unless the strategy evicts)."""
        return self.layers[self.full_layers[0]].held(self.length) if self.full_layers else self.length

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
        """What the cache keeps for each kind of layer, in one line (each kind says it, by its first layer)."""
        return "; ".join(self.layers[members[0]].describe(len(members), self.kind, self.config)
                         for members in layers_by_kind(self.plan).values())


_LABELS: dict[tuple[type, str], str] = {}


def _label(layer, attribute: str) -> str:
    """What the memory report calls ``layer``'s ``attribute`` (its class's :attr:`held_names`, else the name)."""
    key = (type(layer), attribute)
    label = _LABELS.get(key)
    if label is None:
        bare = attribute.lstrip("_")
        label = _LABELS[key] = layer.held_names.get(bare) or bare
    return label


def lossy_by_design(cache: Any) -> bool:
    """Whether ``cache`` gives attention something other than what the model computed, by design (its
    :attr:`~kvexplore.caches.protocol.ModelCache.quantization` says how far), whether or not it keeps its error."""
    return cache.quantization is not None
