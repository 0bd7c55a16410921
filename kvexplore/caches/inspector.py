"""What a cache can say about itself, layer by layer (``cache.inspect``): its storage, the positions each layer read,
the state of every physical slot, and its bytes (the memory report :func:`make_report` builds when a step commits; held
bytes: :mod:`.held`). Every answer comes from the layers' own objects and the cache's public data."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from ..config.layer_plan import LayerSpec, layers_by_kind
from ..core import host
from ..errors import SettingsError
from .held import PLAIN, THIS_STEP, UNDO_SCRATCH, StorageWalk
from .layer import held_label
from .memory import LayerMemory, MemoryReport
from .slots import SlotView

if TYPE_CHECKING:
    from .base import KVCache
    from .layers.sliding import SlidingLayers

#: the container's attributes that are not held memory of their own (the layers are walked one by one; its book,
#: the step's journal, reads and masks, is counted apart; the rest holds no tensor)
_NOT_WALKED = frozenset({"layers", "book", "config", "plan", "allocator"})


def held_walk(cache: "KVCache") -> StorageWalk:
    """Every tensor storage reachable from ``cache``, each counted once, by part (see :mod:`.held`): ``walk.parts``
    (the step's part under :data:`~.held.THIS_STEP`), ``walk.layer_parts`` (per layer)."""
    walk = StorageWalk()
    layer_parts: list[dict[str, int]] = [{} for _ in cache.layers]
    for parts, layer in zip(layer_parts, cache.layers):
        name = held_label(layer, "")
        if got := sum(walk.add_tensor(name, t) for t in layer.storage()):
            parts[name] = got
    shared = []  # each layer's own tensors first, then what it shares (a plan, a page table)
    for parts, layer in zip(layer_parts, cache.layers):
        for name, value in vars(layer).items():
            cls = type(value)
            if cls in PLAIN:
                continue  # nothing held
            if cls is not torch.Tensor:
                shared.append((parts, layer, name, value))
            elif got := walk.add_tensor(label := held_label(layer, name), value):
                parts[label] = parts.get(label, 0) + got
    for parts, layer, name, value in shared:
        if got := walk.add(label := held_label(layer, name), value):
            parts[label] = parts.get(label, 0) + got
    walk.walked(*cache.layers)  # every layer's attributes were walked above, one by one
    for name, value in vars(cache).items():
        if name not in _NOT_WALKED and type(value) not in PLAIN:
            walk.add(name.lstrip("_"), value)
    book = cache.book
    walk.add("sparse_reads", book.reads)
    journal = book.journal  # the step under way: what its journal keeps for the next step is held already
    if journal is not None:
        walk.add(UNDO_SCRATCH, journal.kept_scratch())
    walk.add(THIS_STEP, journal, book.step, book.saved, book.masks, book.scratch if journal else None)
    walk.add(UNDO_SCRATCH, book.scratch)
    walk.layer_parts = layer_parts
    return walk


def layer_memory(cache: "KVCache", walk: StorageWalk | None = None) -> list[LayerMemory]:
    """One :class:`LayerMemory` per layer, each from that layer's own storage and positions; ``walk``: a
    :func:`held_walk` whose per-layer figures fill ``held_bytes`` and ``parts``."""
    moved, n = cache.book.moved, cache.length
    if walk is None:
        return [layer.memory(n, *moved.get(i, (0, 0))) for i, layer in enumerate(cache.layers)]
    return [layer.memory(n, *moved.get(i, (0, 0)), held_bytes=sum(parts.values()), parts=parts)
            for i, (layer, parts) in enumerate(zip(cache.layers, walk.layer_parts))]


def make_report(cache: "KVCache") -> MemoryReport:
    """The memory report of ``cache`` now: the last step's bytes and every byte it holds."""
    s, walk = cache.book.counters, held_walk(cache)
    layers = layer_memory(cache, walk)
    held = dict(walk.parts)
    step = held.pop(THIS_STEP, 0)
    return MemoryReport(
        length=cache.length, logical_bytes=sum(m.logical_bytes for m in layers),
        reserved_bytes=sum(m.reserved_bytes for m in layers),
        analytic_bytes=sum(m.analytic_bytes for m in layers),
        written_bytes=s.written_bytes, copied_bytes=s.copied_bytes, allocated_bytes=s.allocated_bytes,
        freed_bytes=s.freed_bytes, allocations=s.allocations, frees=s.frees, cuda=cache.book.window.figures(),
        cuda_now=cache.allocator.now() if cache.allocator is not None else {}, layers=tuple(layers),
        held_bytes=sum(held.values()), held=held, step_bytes=step)


def report_again(cache: "KVCache", walk: bool = False) -> None:
    """The step was let go: the report's held figures lose what only the step held and count the undo scratch as it
    is now (trimmed), the rest unchanged since the report was made; ``walk``: count everything again (a rollback
    restores the report of before the step, and the step's masks are gone; a copy holds its own storage)."""
    report = cache.book.report
    if report is not None and walk:
        fresh = make_report(cache)
        if (fresh.held, fresh.step_bytes, fresh.layers) != (report.held, report.step_bytes, report.layers):
            cache.book.report = replace(report, layers=fresh.layers, held=fresh.held, held_bytes=fresh.held_bytes,
                                    step_bytes=fresh.step_bytes)
    elif report is not None:
        held = dict(report.held)
        scratch = sum(t.untyped_storage().nbytes() for pool in cache.book.scratch.values() for t in pool)
        before = held.pop(UNDO_SCRATCH, 0)
        if scratch:
            held[UNDO_SCRATCH] = scratch
        cache.book.report = replace(report, held=held, held_bytes=report.held_bytes - before + scratch, step_bytes=0)


class Inspector:
    """The read-only questions of a cache (``cache.inspect``; see the module docstring)."""

    def __init__(self, cache: "KVCache") -> None:
        self.cache = cache

    # -- memory ------------------------------------------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        cache = self.cache
        if cache.book.report is None:
            cache.book.report = make_report(cache)
        return cache.book.report

    def held_walk(self) -> StorageWalk:
        """Every tensor storage reachable from the cache, by part (:func:`held_walk`)."""
        return held_walk(self.cache)

    def layer_memory(self) -> list[LayerMemory]:
        """One :class:`LayerMemory` per layer, after the last step."""
        return layer_memory(self.cache)

    @property
    def reserved_bytes(self) -> int:
        return sum(m.reserved_bytes for m in self.layer_memory())

    @property
    def full_reserved_bytes(self) -> int:
        """Bytes of the strategy's storage for the full layers, used or not."""
        cache = self.cache
        return sum(cache.layers[i].memory(cache.length).reserved_bytes for i in cache.full_layers)

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots that hold valid positions, summed over layers."""
        return sum(m.logical_bytes for m in self.layer_memory())

    @property
    def analytic_bytes(self) -> int:
        """The formula ``2 * kv_heads * head_dim * element_size * batch * held`` summed over the layers' own caches."""
        return sum(m.analytic_bytes for m in self.layer_memory())

    # -- positions -----------------------------------------------------------------------------------------------
    @property
    def held(self) -> int:
        """Positions a full layer holds (``length``, unless the strategy evicts)."""
        cache = self.cache
        return cache.layers[cache.full_layers[0]].positions(cache.length).count if cache.full_layers else cache.length

    def layer_held(self, layer: int) -> int:
        """Positions ``layer`` holds: the strategy's for a full layer, the ring's for a sliding one, 0 shared."""
        return self.cache.layers[self._layer(layer).index].positions(self.cache.length).count

    def held_positions_of(self, layer: int | None = None) -> list[int]:
        """The positions ``layer`` (default: a full layer) holds, in storage order (none for shared or recurrent)."""
        return self.cache.layers[self._layer(layer).index].positions(self.cache.length).held

    def _layer(self, layer: int | None) -> LayerSpec:
        plan = self.cache.plan
        if layer is None:
            full = self.cache.full_layers
            return plan[full[0] if full else 0]
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(plan):
            raise SettingsError(f"layer must be 0..{len(plan) - 1}, got {layer!r}")
        return plan[layer]

    def storage(self, layer: int) -> list[torch.Tensor]:
        """The tensors that hold ``layer``'s cache (a shared layer's: its source's)."""
        return self.cache.layers[self._layer(layer).index].storage()

    # -- reads ---------------------------------------------------------------------------------------------------
    def read_positions(self, layer: int | None = None) -> list[int]:
        """The position of each key column ``layer`` (default: a full layer) read in the last forward pass, in order."""
        spec, sparse = self._layer(layer), self.cache.book.reads
        if spec.index in sparse:
            if isinstance(sparse[spec.index], torch.Tensor):  # still on the device: bring them all over
                pending = self.pending_reads()
                self.land_reads(dict(zip(pending, host.fetch(list(pending.values())))))
            return list(sparse[spec.index])
        return self.cache.layers[spec.index].positions(self.cache.length).read

    def read_window(self, layer: int, count: int) -> tuple[int, int]:
        return self.cache.layers[layer].positions(self.cache.length).start, count

    def read_group(self, layer: int) -> tuple:
        if layer in self.cache.book.reads:
            return ("sparse", layer)
        return self.cache.layers[layer].groups().read

    def pending_reads(self) -> dict[int, torch.Tensor]:
        return {layer: p for layer, p in self.cache.book.reads.items() if isinstance(p, torch.Tensor)}

    def land_reads(self, landed: dict[int, torch.Tensor]) -> None:
        for layer, positions in landed.items():
            self.cache.book.reads[layer] = positions.tolist()

    # -- slots -----------------------------------------------------------------------------------------------------
    def slot_view(self, layer: int | None = None) -> SlotView:
        """The state of every physical slot of ``layer`` (default: a full layer; what the cache map draws)."""
        return self.cache.layers[self._layer(layer).index].positions(self.cache.length).slots()

    def slot_views(self) -> list[SlotView]:
        """:meth:`slot_view` of every layer; layers that look the same share one object (one per kind)."""
        seen: dict[tuple, SlotView] = {}
        out = []
        for layer in self.cache.layers:
            key = layer.groups().view
            if key not in seen:
                seen[key] = layer.positions(self.cache.length).slots()
            out.append(seen[key])
        return out

    @property
    def rings(self) -> "SlidingLayers | None":
        """The slot map the sliding layers' rings share, or None when no layer keeps a ring."""
        cache = self.cache
        return next((layer.slots for s, layer in zip(cache.plan, cache.layers) if s.ring and cache.stores), None)

    # -- what it does ------------------------------------------------------------------------------------------------
    def describe_layers(self) -> str:
        cache = self.cache
        return "; ".join(cache.layers[members[0]].describe(len(members), cache.kind, cache.config)
                         for members in layers_by_kind(cache.plan).values())

    def what_it_did(self) -> str:
        """What a lossy cache did to the sequence so far, in one line, naming the option that changes it; "" for an
        exact one. A lossy strategy's inspector says it."""
        return ""

    #: whether the cache drops positions as it writes, without a press (the sink cache's window): the queries of one
    #: write then read different positions
    evicts_on_write = False

    def crop_error(self, n: int) -> str | None:
        cache = self.cache
        if not 0 <= n <= cache.length:
            return f"cannot cut to {n}: the cache holds {cache.length} positions"
        for spec, layer in zip(cache.plan, cache.layers):
            if msg := layer.take_back(n, cache.length).crop:
                return f"layer {spec.index} ({spec.kind}): {msg}"
        return None

    def crop_ways(self) -> dict[str, str]:
        """How a take-back looks in each kind of layer this cache has: the layer class's name -> the way, in words."""
        n = self.cache.length
        return {type(layer).__name__: layer.take_back(n, n).way for layer in self.cache.layers}

    def speculation_refusal(self) -> str | None:
        return None

    # -- going back ----------------------------------------------------------------------------------------------
    def replay_error(self, n: int) -> str | None:
        """Why some layer (a ring, a recurrent state) cannot go back to ``n`` positions although recomputing would
        rebuild it (None: every layer can); the generator then recomputes instead (:meth:`needs_replay`)."""
        length = self.cache.length
        for layer in self.cache.layers:
            if msg := layer.take_back(n, length).replay:
                return msg
        return None

    def needs_replay(self, n: int) -> bool:
        """True when only the sliding layers' rings or the linear-attention states stop a truncate to ``n``: going
        back means recomputing the sequence's first ``n`` positions (what :meth:`kvexplore.Generator.rewind` does)."""
        if not 0 <= n <= self.cache.length or self.replay_error(n) is None:
            return False
        try:
            self.cache.check_truncate(n, rings=False)
        except SettingsError:
            return False
        return True


def lossy_by_design(cache: Any) -> bool:
    """Whether ``cache`` gives attention something other than what the model computed, by design (its
    :attr:`~kvexplore.caches.protocol.ModelCache.quantization` says how far), whether or not it keeps its error."""
    return cache.quantization is not None
