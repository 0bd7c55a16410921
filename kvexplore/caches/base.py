"""The interface every KV cache strategy implements, and the checks they share.

Layout, stated once: keys and values are ``[batch, kv_heads, seq, head_dim]`` and keys are stored *after* RoPE.

A cache is a stack of layer caches that may differ (see :mod:`kvexplore.config.layer_plan`): the strategy (pre-allocated,
paged, ...) serves the *full-attention* layers; *sliding-window* layers always get a ring of the model's window
(:mod:`.ring`), whatever the strategy; *shared* layers store nothing and read their source layer's keys and
values. This class does the dispatch, the per-layer accounting and the shared-layer reads; a strategy implements
``_write``, ``_slot_view``, ``full_reserved_bytes`` and ``_clone_storage`` for its full layers.

Who owns what: the caller (the :class:`~kvexplore.Generator`) decides the position of every write; the cache
only records how many leading positions hold valid data (``length``). A forward pass calls
``check_write(pos, q_len)`` before touching anything, ``write(layer, pos, k, v)`` once per layer, then
``commit(pos + q_len)``. A check that fails raises before any layer writes, so a failed step leaves the cache
exactly as it was.

A step can also fail after some layers wrote (an exception in a hook, an interrupt) or after ``commit`` (the
generator then finds the logits unusable): :meth:`rollback` puts back everything the last step changed, so the
cache is exactly as it was before ``begin_step`` (its length, slot map, memory report and the keys and values it
held). ``begin_step`` saves the bookkeeping (:meth:`_snapshot`); a strategy that overwrites held slots in place
saves those slots first (:meth:`_keep`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..config.model_config import ModelConfig
from ..errors import SettingsError
from ..config.layer_plan import FULL, SHARED as SHARED_LAYER, SLIDING, STATE, LayerSpec, layer_plan
from ..core.allocator import Window, allocator_for
from .memory import MemoryReport, StepCounters
from ..core.settings import positive_int
from .inspection import CacheInspection
from .masks import causal_mask
from .ring import SlidingLayers
from .state import StateLayers
from .slots import EVICTED, FILLED, FREE, SHARED, STALE, SlotView  # noqa: F401 (the strategies import them here)


class KVCache(CacheInspection, ABC):
    """Base class of the cache strategies. Subclasses implement storage for the full layers; this class keeps the
    length, the sliding layers' rings and the shared layers' reads."""

    #: short name used by the CLI and in records
    kind: str = "base"
    #: whether sliding layers get rings (a cache that stores nothing recomputes them under a window mask instead)
    rings_for_sliding = True

    def __init__(self, config: ModelConfig, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        positive_int(batch_size, "batch_size")
        self.config = config
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.plan: list[LayerSpec] = layer_plan(config)
        self.full_layers = [s.index for s in self.plan if s.kind == FULL]  # the layers the strategy serves
        sliding = [s for s in self.plan if s.kind == SLIDING]
        self.rings = SlidingLayers(sliding, batch_size, dtype, self.device) if sliding and self.rings_for_sliding \
            else None
        states = [s for s in self.plan if s.kind == STATE]
        self.states = StateLayers(states, config, batch_size, dtype, self.device) if states else None
        self._length = 0
        self._capacity: int | None = None  # most positions a sequence may reach (None: unbounded)
        self._step = StepCounters()
        self._layer_moved: dict[int, tuple[int, int]] = {}  # layer -> (written, copied) bytes this step
        self._reads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # this step's reads of shared layers' sources
        self._masks: dict[str, torch.Tensor | None] = {}  # this step's mask per attention type
        self._sources = {s.source for s in self.plan if s.kind == SHARED_LAYER}
        self._sparse_reads: dict[int, list[int]] = {}  # layer -> the positions a sparse attention read this step
        self.allocator = allocator_for(self.device)  # read around each write (kvexplore.core.allocator); None: not read
        self._window = Window(None)  # the allocator's counters over this step's writes
        self._report: MemoryReport | None = None  # built on first request: subclasses allocate after this
        self._undo: dict | None = None  # the bookkeeping before the current step (see rollback)
        self._undo_data: list[tuple[torch.Tensor, int, int, torch.Tensor | int]] = []  # slots a step overwrote
        self._scratch: dict[tuple, list[torch.Tensor]] = {}  # reused buffers of _keep, by shape and dtype
        self._scratch_used: dict[tuple, int] = {}

    def _full_shape(self, layer: int, slots: int, values: bool = False) -> tuple[int, int, int, int]:
        """``(batch, kv_heads, slots, head_dim)`` of a full layer's key storage of ``slots`` positions (``values``:
        its value storage, which an MLA layer makes narrower)."""
        s = self.plan[layer]
        return (self.batch_size, s.kv_heads, slots, s.value_width if values else s.head_dim)

    def _per_full_layer(self, make) -> list:
        """``make(layer)`` for each full layer, None for the others (a list indexed by layer)."""
        return [make(s.index) if s.kind == FULL else None for s in self.plan]

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
        if msg := self._recompute_error(pos):
            raise SettingsError(f"write at position {pos} needs a rewind: {msg}")

    def _recompute_error(self, n: int) -> str | None:
        """Why the sliding rings or the linear-attention states cannot go back to ``n`` positions (None: they can);
        the generator then recomputes instead (:meth:`needs_replay`)."""
        if self.rings is not None and (msg := self.rings.rewind_error(n, self.length)):
            return msg
        if self.states is not None and 0 < n < self.length:
            return (f"the linear-attention layers keep one state, of position {self.length - 1}, and cannot go back "
                    f"to {n}; rewind with the generator (it recomputes), or start again from position 0")
        return None

    def begin_step(self, pos: int = 0, q_len: int = 0) -> None:
        """Start a forward pass writing ``q_len`` positions at ``pos`` (after ``check_write`` passed): count its
        writes, copies and allocations, and save what :meth:`rollback` needs to undo it."""
        self._undo, self._undo_data, self._scratch_used = self._snapshot(), [], {}
        self._step = StepCounters()
        self._layer_moved, self._reads, self._masks, self._sparse_reads = {}, {}, {}, {}
        if self.rings is not None:
            self.rings.begin()
        if self.states is not None and pos == 0:  # a new sequence starts from zero state
            self.states.clear(self)
        self._window = Window(self.allocator)

    def _snapshot(self) -> dict:
        """The bookkeeping a step may change, as copies (subclasses add theirs)."""
        return {"_length": self._length, "_step": self._step, "_report": self._report,
                "_window": self._window, "_layer_moved": dict(self._layer_moved),
                "_sparse_reads": dict(self._sparse_reads),
                "_rings": None if self.rings is None else self.rings.snapshot()}

    def _restore(self, snapshot: dict) -> None:
        snapshot = dict(snapshot)
        rings = snapshot.pop("_rings")
        if self.rings is not None:
            self.rings.restore(rings)
        self._reads, self._masks = {}, {}
        for name, value in snapshot.items():
            setattr(self, name, value)

    def _keep(self, t: torch.Tensor, dim: int, start: int, n: int) -> None:
        """Save ``t.narrow(dim, start, n)`` before the step overwrites it in place. The copy goes into a scratch
        buffer the cache keeps for the next steps (one per shape used in a step), so a step that saves what it
        saved last time allocates nothing."""
        if self._undo is None or n <= 0:
            return
        src = t.narrow(dim, start, n)
        key = (tuple(src.shape), src.dtype)
        used = self._scratch_used.get(key, 0)
        pool = self._scratch.setdefault(key, [])
        if used == len(pool):
            pool.append(torch.empty_like(src, memory_format=torch.contiguous_format))
        self._scratch_used[key] = used + 1
        saved = pool[used]
        saved.copy_(src)
        self._undo_data.append((t, dim, start, saved))

    def _zero_on_undo(self, t: torch.Tensor, dim: int, start: int, n: int) -> None:
        """The step writes ``t.narrow(dim, start, n)``, which was never written before (zeros): a rollback zeroes it
        again, with no copy saved."""
        if self._undo is not None and n > 0:
            self._undo_data.append((t, dim, start, n))

    @property
    def undo_length(self) -> int:
        """The length before the current step began (what a rollback returns to)."""
        return self._length if self._undo is None else self._undo["_length"]

    def settle(self) -> None:
        """Forget how to undo the last step: from here on :meth:`rollback` does nothing until a step begins. What
        the undo record kept alive is freed now (a concatenating cache's old storage): the step's report counts it."""
        had_step = self._undo is not None
        window = Window(self.allocator if had_step else None)
        with window:
            self._undo, self._undo_data = None, []
            self._reads = {}
        if self._report is not None:
            for name, n in window.figures().items():
                self._report.cuda[name] = self._report.cuda.get(name, 0) + n

    def rollback(self) -> None:
        """Undo the last step (written or committed) exactly: length, slots, memory report, held keys and values.
        Does nothing when there is no step to undo (none began, or it was already rolled back)."""
        if self._undo is None:
            return
        for t, dim, start, saved in reversed(self._undo_data):
            if isinstance(saved, int):
                t.narrow(dim, start, saved).zero_()
            else:
                t.narrow(dim, start, saved.shape[dim]).copy_(saved)
        self._restore(self._undo)
        self._undo, self._undo_data = None, []

    # -- the write protocol --------------------------------------------------------------------------------
    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``(B, kv_heads, q_len, hd)`` for positions ``pos..pos+q_len-1`` of ``layer`` and
        return the keys/values its attention must read (in the order :meth:`read_positions` gives; use
        :meth:`mask` for the mask that goes with them). A shared layer stores nothing: use :meth:`read_shared`."""
        spec = self.plan[layer]
        if spec.kind == SHARED_LAYER:
            raise SettingsError(f"layer {layer} shares layer {spec.source}'s cache and stores nothing; read it with "
                                f"read_shared({layer})")
        step = self._step
        before = (step.written_bytes, step.copied_bytes)
        with self._window:  # what the allocator does inside the cache's own write, and nothing else
            if spec.kind == SLIDING and self.rings is not None:
                out = self.rings.write(self, layer, pos, k, v)
            else:
                out = self._write(layer, pos, k, v)
        self._layer_moved[layer] = (step.written_bytes - before[0], step.copied_bytes - before[1])
        if layer in self._sources:
            self._reads[layer] = out
        return out

    def read_state(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear-attention layer's state: its convolution's last inputs and its recurrent matrix."""
        if self.plan[layer].kind != STATE:
            raise SettingsError(f"layer {layer} is not a linear-attention layer; it has no state")
        return self.states.read(layer)

    def write_state(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """Replace a linear-attention layer's state (in place: its storage never moves or grows)."""
        if self.plan[layer].kind != STATE:
            raise SettingsError(f"layer {layer} is not a linear-attention layer; it has no state")
        step = self._step
        before = step.written_bytes
        with self._window:
            self.states.write(self, layer, conv, recurrent)
        self._layer_moved[layer] = (step.written_bytes - before, 0)

    def note_reads(self, layer: int, positions: torch.Tensor | list[int], copied_bytes: int) -> None:
        """A layer's attention read only ``positions`` (gathered into ``copied_bytes`` of temporaries): what
        :meth:`read_positions` reports for it until the next step (DeepSeek-V3.2's sparse attention). A tensor of
        positions stays where it is until someone asks (a tracer brings them over with the rest of its step)."""
        self._sparse_reads[layer] = positions
        s = self._step
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
        spec = self.plan[layer]
        if layer in self._sparse_reads:
            return ("sparse", layer)
        return (spec.attends, spec.source if spec.kind == SHARED_LAYER else -1)

    def read_shared(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a shared layer reads: what its source layer's attention read this step."""
        spec = self.plan[layer]
        if spec.kind != SHARED_LAYER:
            raise SettingsError(f"layer {layer} stores its own cache ({spec.kind}); write it with write()")
        if spec.source not in self._reads:
            raise SettingsError(f"layer {layer} reads layer {spec.source}'s cache, which has not been written this "
                                f"step; run the layers in order")
        return self._reads[spec.source]

    def mask(self, layer: int, pos: int, q_len: int) -> torch.Tensor | None:
        """The boolean ``(q_len, keys)`` mask for what ``write`` (or ``read_shared``) returned for ``layer`` this
        step, or None when plain causal attention (or none, for one token) is exact. The same for every layer of
        one attention type, so it is built once per step."""
        spec = self.plan[layer]
        if spec.attends not in self._masks:
            if spec.attends == SLIDING and self.rings is not None:
                m = self.rings.plan.mask
            elif spec.attends == SLIDING:
                m = causal_mask(pos, q_len, spec.window, self.device)
            else:
                m = self._full_mask(pos, q_len)
            self._masks[spec.attends] = m
        return self._masks[spec.attends]

    def _full_mask(self, pos: int, q_len: int) -> torch.Tensor | None:
        """The mask of a full layer's read (keys ``0..pos+q_len-1`` in position order, unless a strategy says)."""
        return causal_mask(pos, q_len, None, self.device)

    @abstractmethod
    def _write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The strategy's write of one full layer: store ``k``/``v`` and return ``(B, kv_heads, keys, hd)``."""

    def commit(self, end: int) -> None:
        """Record that every layer now holds positions ``0..end-1`` (called once per forward pass)."""
        self._length = end
        if self.rings is not None:
            self.rings.commit()
        self._report = self._make_report()

    def memory_report(self) -> MemoryReport:
        """Memory after the last forward pass (its writes, copies and allocations) or after a rewind."""
        if self._report is None:
            self._report = self._make_report()
        return self._report

    def _make_report(self) -> MemoryReport:
        s = self._step
        return MemoryReport(
            length=self.length, logical_bytes=self.used_bytes, reserved_bytes=self.reserved_bytes,
            analytic_bytes=self.analytic_bytes,
            written_bytes=s.written_bytes, copied_bytes=s.copied_bytes, allocated_bytes=s.allocated_bytes,
            freed_bytes=s.freed_bytes, allocations=s.allocations, frees=s.frees, cuda=self._window.figures(),
            cuda_now=self.allocator.now() if self.allocator is not None else {},
            layers=tuple(self.layer_memory()))

    def check_truncate(self, n: int, rings: bool = True) -> None:
        """Raise, changing nothing, if the cache cannot be truncated to ``n`` positions (so several caches can be
        checked before any is rewound). ``rings=False``: check only what the strategy itself allows."""
        if not 0 <= n <= self.length:
            raise SettingsError(f"cannot truncate to {n}: the cache holds {self.length} positions (0 <= n <= {self.length})")
        if rings and (msg := self._recompute_error(n)):
            raise SettingsError(f"cannot truncate to {n}: {msg}")

    def needs_replay(self, n: int) -> bool:
        """True when only the sliding layers' rings or the linear-attention states stop a truncate to ``n``: going
        back means recomputing the sequence's first ``n`` positions (what :meth:`kvexplore.Generator.rewind` does)."""
        if not 0 <= n <= self.length or self._recompute_error(n) is None:
            return False
        try:
            self.check_truncate(n, rings=False)
        except SettingsError:
            return False
        return True

    def truncate(self, n: int) -> None:
        """Rewind: keep only the first ``n`` positions. Storage is not cleared; the length moves back."""
        self.check_truncate(n)
        self._length = n
        self._step = StepCounters()
        self._layer_moved, self._reads, self._sparse_reads = {}, {}, {}
        if self.rings is not None:
            self.rings.last_read = None
        if self.states is not None and n == 0:
            for t in (*self.states.conv.values(), *self.states.recurrent.values()):
                t.zero_()
        self._report = None
        self._undo, self._undo_data = None, []

    def clone(self) -> "KVCache":
        """An independent copy: writes to either never show in the other."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        twin.rings = None if self.rings is None else self.rings.clone()
        twin.states = None if self.states is None else self.states.clone()
        twin._undo, twin._undo_data, twin._reads, twin._masks = None, [], {}, {}
        twin._scratch, twin._scratch_used = {}, {}
        self._clone_storage(twin)
        return twin

    @abstractmethod
    def _clone_storage(self, twin: "KVCache") -> None:
        """Give ``twin`` (a shallow copy of this cache) its own copies of the strategy's storage."""

    def fork(self) -> "KVCache":
        """A cache for a second sequence continuing from this one's prefix. By default an independent copy;
        strategies that can share storage (the paged cache) share it until the sequences diverge."""
        self._check_forkable()
        return self.clone()

    def _check_forkable(self) -> None:
        if self.length == 0:
            raise SettingsError(f"cannot fork an empty {type(self).__name__}: there is no prefix to share; "
                             f"make a new cache instead")

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else self.capacity
        return (f"{type(self).__name__}(length={self.length}, capacity={cap}, batch_size={self.batch_size}, "
                f"dtype={self.dtype}, device={self.device}, reserved={self.reserved_bytes} B, "
                f"layers: {self.describe_layers()})")
