"""The model-level cache: the list of layer caches plus the step's bookkeeping.

A cache is a stack of layer caches that may differ (see :mod:`kvexplore.config.layer_plan`): one
:class:`~kvexplore.caches.layer.LayerCache` per layer, chosen by the layer-kind registry
(:mod:`kvexplore.caches.registry`). A strategy (pre-allocated, paged, ...) is a subclass of :class:`KVCache` whose
:meth:`KVCache.full_layer` makes the cache of each *full-attention* layer; *sliding-window* layers get a ring of the
model's window, *shared* layers read their source layer's keys and values, *linear-attention* layers keep a state.
This class keeps the length, the step (its counters, its undo journal, its masks per attention type) and
dispatches every call to the layer's object; it never asks what kind a layer is.

Who owns what: the caller (the :class:`~kvexplore.Generator`) decides the position of every write; the cache
only records how many leading positions hold valid data (``length``). A forward pass calls
``check_write(pos, q_len)`` before touching anything, ``begin_step(pos, q_len)`` (which plans the step in every
layer), ``write(layer, pos, k, v)`` once per layer, then ``commit(pos + q_len)``. A check that fails raises before
any layer writes, so a failed step leaves the cache exactly as it was.

A step can also fail after some layers wrote (an exception in a hook, an interrupt) or after ``commit`` (the
generator then finds the logits unusable): :meth:`rollback` puts back everything the last step changed, so the
cache is exactly as it was before ``begin_step`` (its length, slot map, memory report and the keys and values it
held), from the step's :class:`~kvexplore.caches.journal.UndoJournal`.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from ..config.layer_plan import LayerSpec, layer_plan
from ..config.model_config import ModelConfig
from ..core.allocator import Window, allocator_for
from ..core.settings import positive_int
from ..errors import CacheFullError, SettingsError
from .rewind import Rewind
from .steps import StepCycle
from .inspection import CacheInspection
from .journal import UndoJournal
from .layers.state import StateLayers
from .layers.sliding import SlidingLayers
from .layer import LayerCache, Step
from .memory import MemoryReport, StepCounters
from .protocol import ModelCache
from .registry import build_layers
from .slots import EVICTED, FILLED, FREE, SHARED, STALE, SlotView  # noqa: F401 (the strategies import them here)


class KVCache(CacheInspection, StepCycle, Rewind, ModelCache):
    """Base class of the cache strategies: the layer caches (``layers``) and the step's bookkeeping. A strategy
    implements :meth:`full_layer` (the factory of its full-layer caches) and calls :meth:`_build` at the end of
    its ``__init__``, once its options are set."""

    #: short name used by the CLI and in records
    kind: str = "base"
    #: whether the cache keeps keys and values between steps (a cache that stores nothing recomputes every layer,
    #: sliding ones under a window mask, instead of keeping rings)
    stores = True

    def __init__(self, config: ModelConfig, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        positive_int(batch_size, "batch_size")
        self.config = config
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.plan: list[LayerSpec] = layer_plan(config)
        self.layers: list[LayerCache] = []
        self._length = 0
        self._capacity: int | None = None  # most positions a sequence may reach (None: unbounded)
        self._counters = StepCounters()
        self._cur: Step | None = None  # the step under way (or the last one, committed)
        self._layer_moved: dict[int, tuple[int, int]] = {}  # layer -> (written, copied) bytes this step
        self._masks: dict[str, torch.Tensor | None] = {}  # this step's mask per attention type
        self._sparse_reads: dict[int, list[int]] = {}  # layer -> the positions a sparse attention read this step
        self.allocator = allocator_for(self.device)  # read around each write (kvexplore.core.allocator); None: not read
        self._window = Window(None)  # the allocator's counters over this step's writes
        self._report: MemoryReport | None = None  # built on first request
        self._journal: UndoJournal | None = None  # how to undo the current step (see rollback)
        self._saved: tuple | None = None  # the container's bookkeeping before the current step
        self._scratch: dict[tuple, list[torch.Tensor]] = {}  # reused copy buffers of the journals

    def _build(self) -> None:
        """Make every layer's cache (through the layer-kind registry); strategies call it once their options are set."""
        self.layers = build_layers(self)
        self._index()

    def _index(self) -> None:
        """What the per-step path needs, worked out once: the layers that plan or commit a step, the sources of
        shared layers, the full layers."""
        self._planners = [l for l in self.layers if type(l).begin is not LayerCache.begin]
        self._committers = [l for l in self.layers if type(l).commit is not LayerCache.commit]
        self._sources = {s.source for s, l in zip(self.plan, self.layers) if s.shares}
        self.full_layers = [s.index for s in self.plan if s.full]  # the layers the strategy serves

    @abstractmethod
    def full_layer(self, spec: LayerSpec) -> LayerCache:
        """The strategy's cache for one full-attention layer (the strategy is a factory of these)."""

    @classmethod
    def sizing(cls, slots: int, options: dict) -> int | None:
        """How :func:`~kvexplore.caches.factory.make_cache` sizes this strategy from ``slots`` (``max_seq_len``, or the
        model's context): add to ``options`` what the constructor needs, and return the positions per sequence
        its storage will hold (checked against the device's memory before allocating; None: it grows, no check)."""
        return None

    def refuses(self, spec: LayerSpec) -> str | None:
        """Why this strategy cannot serve ``spec``'s full layer (None: it can); checked before any layer is made."""
        return None

    @property
    def states(self) -> StateLayers | None:
        """The linear-attention layers' states by layer (``states.read(layer)``), or None when there are none."""
        layers = {s.index: self.layers[s.index] for s in self.plan if s.recurrent}
        return StateLayers(layers) if layers else None

    @property
    def rings(self) -> SlidingLayers | None:
        """The slot map the sliding layers' rings share, or None when no layer keeps a ring."""
        return next((layer.slots for s, layer in zip(self.plan, self.layers) if s.ring and self.stores), None)

    @property
    def length(self) -> int:
        """Number of positions of the sequence the cache has taken in (full layers hold all of them)."""
        return self._length

    @property
    def capacity(self) -> int | None:
        """Most positions the cache can hold, or ``None`` when unbounded."""
        return self._capacity

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        """Raise, before anything is written, if ``q_len`` positions cannot be written at ``pos``."""
        if batch_size != self.batch_size:
            raise SettingsError(
                f"batch of {batch_size} sequences but the cache was made for batch_size={self.batch_size}; "
                f"make a cache with batch_size={batch_size}"
            )
        if pos < 0 or pos > self.length:
            raise SettingsError(
                f"write at position {pos} but the cache holds {self.length} positions; writes must start at or "
                f"before the end (pos <= {self.length}) so no slot is left unwritten"
            )
        if pos < self.length and (msg := self._recompute_error(pos)):
            raise SettingsError(f"write at position {pos} needs a rewind: {msg}")
        if self._capacity is not None and pos + q_len > self._capacity:  # the fixed capacity of a bounded cache
            raise CacheFullError(used=pos, needed=q_len, capacity=self._capacity)

    # -- the write protocol --------------------------------------------------------------------------------
    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``(B, kv_heads, q_len, hd)`` for positions ``pos..pos+q_len-1`` of ``layer`` and
        return the keys/values its attention must read (in the order :meth:`read_positions` gives; use
        :meth:`mask` for the mask that goes with them). A shared layer stores nothing: use :meth:`read_shared`."""
        step = self._step_for(pos, k.shape[2])
        c = step.counters
        written, copied = c.written_bytes, c.copied_bytes
        with self._window:  # what the allocator does inside the cache's own write, and nothing else
            out = self.layers[layer].write(step, k, v)
        self._layer_moved[layer] = (c.written_bytes - written, c.copied_bytes - copied)
        if layer in self._sources:
            step.reads[layer] = out
        return out

    def attach_model(self, model) -> None:
        """The model about to run a step through this cache (a cache that re-rotates keys keeps its rotary)."""
    def observes_queries(self, layer: int) -> bool:
        """Whether ``layer``'s attention hands its queries over with :meth:`note_queries` (a press reads them)."""
        return False

    def note_queries(self, layer: int, q: torch.Tensor) -> None:
        """``layer``'s queries ``(B, heads, q_len, head_dim)`` this step, after RoPE."""

    def read_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear-attention layer's state: its convolution's last inputs and its recurrent matrix."""
        return self.layers[layer].read_state()

    def write_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor, checkpoints=None) -> None:
        """Replace a linear-attention layer's state in place; ``checkpoints`` (see :attr:`checkpointing`)."""
        target, step = self.layers[layer], self._cur
        target.read_state()  # raises for a layer that has no state, before a step is started
        if step is None or step.committed:
            step = self._start(self._length, 0, None)
        before = step.counters.written_bytes
        with self._window:
            target.write_state(step, conv, recurrent, checkpoints)
        self._layer_moved[layer] = (step.counters.written_bytes - before, 0)

    def note_reads(self, layer: int, positions: torch.Tensor | list[int], copied_bytes: int) -> None:
        """A layer's attention read only ``positions`` (gathered into ``copied_bytes`` of temporaries): what
        :meth:`read_positions` reports for it until the next step (DeepSeek-V3.2's sparse attention). A tensor of
        positions stays where it is until someone asks (a tracer brings them over with the rest of its step)."""
        self._sparse_reads[layer] = positions
        s = self._counters
        s.copied_bytes += copied_bytes
        s.allocated_bytes += copied_bytes
        s.freed_bytes += copied_bytes
        s.allocations += 2
        s.frees += 2
        written, copied = self._layer_moved.get(layer, (0, 0))
        self._layer_moved[layer] = (written, copied + copied_bytes)

    def pending_reads(self) -> dict[int, torch.Tensor]:
        """The sparse reads of this step still on the device (layer -> positions), for :meth:`land_reads`."""
        return {layer: p for layer, p in self._sparse_reads.items() if isinstance(p, torch.Tensor)}

    def land_reads(self, landed: dict[int, torch.Tensor]) -> None:
        """Replace sparse reads by their host copies (from :func:`kvexplore.core.host.fetch`)."""
        for layer, positions in landed.items():
            self._sparse_reads[layer] = positions.tolist()

    def read_group(self, layer: int) -> tuple:
        """Layers with the same read group read the same positions in a step (the tracer records one list each)."""
        if layer in self._sparse_reads:
            return ("sparse", layer)
        return self.layers[layer].read_group()

    def read_shared(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a shared layer reads: what its source layer's attention read this step."""
        return self.layers[layer].read(self._cur)

    def mask(self, layer: int, pos: int, q_len: int) -> torch.Tensor | None:
        """The boolean ``(q_len, keys)`` mask for what ``write`` (or ``read_shared``) returned for ``layer`` this
        step, or ``(batch, kv_heads, q_len, keys)`` when each KV head reads its own keys (a pressed layer), or None
        when plain causal attention (or none, for one token) is exact. Built once per step for the layers of one
        mask group (by default: one attention type)."""
        target = self.layers[layer]
        group = target.mask_group()
        if group not in self._masks:
            self._masks[group] = target.mask(self._step_for(pos, q_len))
        return self._masks[group]

    def commit(self, end: int) -> None:
        """Record that every layer now holds positions ``0..end-1`` (called once per forward pass)."""
        self._length = end
        step = self._cur
        if step is not None and not step.committed:
            for layer in self._committers:
                layer.commit(step)
            step.committed = True
        self._report = self._make_report()

    # -- copies -------------------------------------------------------------------------------------------
    def _copy(self, how: str) -> "KVCache":
        """A copy whose layers are ``layer.clone`` or ``layer.fork`` (structures several layers share are copied
        once and shared by the copies)."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        memo: dict[int, object] = {}
        twin.layers = []
        for layer in self.layers:
            copy = getattr(layer, how)(memo)
            memo[id(layer)] = copy
            twin.layers.append(copy)
        twin._index()
        twin._journal, twin._saved, twin._cur, twin._masks = None, None, None, {}
        twin._scratch = {}
        self._copy_report_to(twin)
        return twin

    def clone(self) -> "KVCache":
        """An independent copy: writes to either never show in the other."""
        return self._copy("clone")

    def fork(self) -> "KVCache":
        """A cache for a second sequence continuing from this one's prefix. By default an independent copy;
        strategies that can share storage (the paged cache) share it until the sequences diverge."""
        self._check_forkable()
        return self._copy("fork")

    def _check_forkable(self) -> None:
        if self.length == 0:
            raise SettingsError(f"cannot fork an empty {type(self).__name__}: there is no prefix to share; "
                                f"make a new cache instead")

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else self.capacity
        return (f"{type(self).__name__}(length={self.length}, capacity={cap}, batch_size={self.batch_size}, "
                f"dtype={self.dtype}, device={self.device}, reserved={self.reserved_bytes} B, "
                f"layers: {self.describe_layers()})")
