"""The model-level cache: the list of layer caches plus the step's bookkeeping, in one class. One
:class:`~kvexplore.caches.layer.LayerCache` per layer, chosen by the layer-kind registry
(:mod:`kvexplore.caches.registry`); a strategy is a subclass of :class:`KVCache` whose :meth:`KVCache.full_layer` makes
the cache of each full-attention layer. This class keeps the length and the step (its counters, undo journal and masks)
and dispatches every call to the layer's object; it never asks what kind a layer is (docs/extending.md).

The caller decides the position of every write; the cache only records how many leading positions are valid
(``length``). A pass (:func:`~kvexplore.caches.one_pass.one_pass`) calls ``check_write`` (which raises before any layer
writes), ``begin_step``, one ``write`` per layer and ``commit``; :meth:`KVCache.rollback` puts back everything the last
step changed, from its :class:`~kvexplore.caches.journal.UndoJournal`, and :meth:`KVCache.settle` forgets how.
:meth:`KVCache.truncate` keeps the first ``n`` positions where every layer allows it (where only rings or recurrent
states stop it the generator recomputes: ``cache.inspect.needs_replay(n)``)."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from ..config.layer_plan import LayerSpec, layer_plan
from ..config.model_config import ModelConfig
from ..core.allocator import Window, allocator_for
from ..core.settings import positive_int
from ..errors import CacheFullError, SettingsError
from .inspector import Inspector, make_report, report_again
from .book import StepBook
from .journal import UndoJournal
from .layer import LayerCache, Step, shallow_copy
from .memory import StepCounters
from .protocol import ModelCache
from .registry import build_layers
from .slots import EVICTED, FILLED, FREE, SHARED, STALE, SlotView  # noqa: F401 (the strategies import them here)


class KVCache(ModelCache):
    """Base class of the cache strategies: the layer caches (``layers``) and the step's bookkeeping. A strategy
    implements :meth:`full_layer` and calls :meth:`_build` at the end of its ``__init__``, once its options are set.
    Data every cache has: ``config``, ``plan`` (a :class:`~kvexplore.config.layer_plan.LayerSpec` per layer),
    ``layers``, ``full_layers``, ``batch_size``, ``dtype``, ``device``, ``allocator`` (read around writes, or None)."""

    #: short name used by the CLI and in records
    kind: str = "base"
    #: whether the cache keeps keys and values between steps (a cache that stores nothing recomputes every layer,
    #: sliding ones under a window mask, instead of keeping rings)
    stores = True
    #: sliding-window layers in the strategy's storage, every position, read under the window (a prefix pool shares
    #: them as pages), instead of the ring every other strategy keeps
    keeps_windows_whole = False

    def __init__(self, config: ModelConfig, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        positive_int(batch_size, "batch_size")
        self.config, self.batch_size, self.dtype = config, batch_size, dtype
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self.plan: list[LayerSpec] = layer_plan(config)
        self.layers: list[LayerCache] = []
        self._length = 0
        self._capacity: int | None = None  # most positions a sequence may reach (None: unbounded)
        self.allocator = allocator_for(self.device)  # read around each write (kvexplore.core.allocator); None: not read
        self.book = StepBook()  # the step's counters, bytes moved, reads, report and undo (kvexplore.caches.book)
        self._checkpointing = False  # inside checkpointing_states(): the states after each position are kept

    def _build(self) -> None:
        """Make every layer's cache (through the layer-kind registry); strategies call it once their options are set."""
        self.layers = build_layers(self)
        self._index()

    def _index(self) -> None:
        """What the per-step path needs, worked out once: planners, committers, shared layers' sources, full layers."""
        self._planners = [l for l in self.layers if type(l).begin is not LayerCache.begin]
        self._committers = [l for l in self.layers if type(l).commit is not LayerCache.commit]
        self._sources = {s.source for s, l in zip(self.plan, self.layers) if s.shares}
        self.full_layers = [s.index for s in self.plan if s.full]  # the layers the strategy serves

    # -- what a strategy declares ------------------------------------------------------------------------------
    @abstractmethod
    def full_layer(self, spec: LayerSpec) -> LayerCache:
        """The strategy's cache for one full-attention layer (the strategy is a factory of these)."""

    def refuses(self, spec: LayerSpec) -> str | None:
        """Why this strategy cannot serve ``spec``'s full layer (None: it can); checked before any layer is made."""
        return None

    def _attach(self, model: Any) -> None:
        """The model about to run a step through this cache (a cache that re-rotates keys keeps its rotary)."""

    def _note_queries(self, layer: int, q: torch.Tensor) -> None:
        """``layer``'s queries this step, handed over with its write (a press reads them)."""

    # -- the container -----------------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        """Number of positions of the sequence the cache has taken in (full layers hold all of them)."""
        return self._length

    @property
    def capacity(self) -> int | None:
        """Most positions the cache can hold, or ``None`` when unbounded."""
        return self._capacity

    @property
    def inspect(self) -> Inspector:
        """What the cache can say about itself: memory, slots, reads, storage (:class:`~.inspector.Inspector`)."""
        return Inspector(self)

    @property
    def states(self) -> "States | None":
        """The linear-attention layers' states (:class:`States`), or None when the model has none."""
        layers = {s.index: self.layers[s.index] for s in self.plan if s.recurrent}
        return States(self, layers) if layers else None

    # -- a step ------------------------------------------------------------------------------------------------
    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        """Raise, before anything is written, if ``q_len`` positions cannot be written at ``pos``."""
        if batch_size != self.batch_size:
            raise SettingsError(f"batch of {batch_size} sequences but the cache was made for batch_size="
                                f"{self.batch_size}; make a cache with batch_size={batch_size}")
        if pos < 0 or pos > self.length:
            raise SettingsError(f"write at position {pos} but the cache holds {self.length} positions; writes must "
                                f"start at or before the end (pos <= {self.length}) so no slot is left unwritten")
        if pos < self.length and (msg := self.inspect.replay_error(pos)):
            raise SettingsError(f"write at position {pos} needs a rewind: {msg}")
        if self._capacity is not None and pos + q_len > self._capacity:  # the fixed capacity of a bounded cache
            raise CacheFullError(used=pos, needed=q_len, capacity=self._capacity)

    def begin_step(self, pos: int = 0, q_len: int = 0, model: Any = None) -> None:
        """Start a forward pass of ``model`` writing ``q_len`` positions at ``pos`` (after ``check_write`` passed):
        plan it in every layer, count its writes, copies and allocations, open the journal :meth:`rollback` undoes."""
        if model is not None:
            self._attach(model)
        book = self.book
        book.saved = (self._length, book.figures())
        book.journal = UndoJournal(book.scratch, q_len)
        self._start(pos, q_len, book.journal)
        book.window = Window(self.allocator)

    def _start(self, pos: int, q_len: int, journal: UndoJournal | None) -> Step:
        book = self.book
        step = book.step = Step(pos, q_len, self._length, self.device, journal)
        book.counters = step.counters
        book.moved, book.masks, book.reads = {}, {}, {}
        for layer in self._planners:
            layer.begin(step)
        return step

    def _step_for(self, pos: int, q_len: int) -> Step:
        """The step under way, or one started now for a write without ``begin_step`` (no undo is kept)."""
        step = self.book.step
        if step is None or step.committed:
            return self._start(pos, q_len, None)
        if step.pos != pos or step.q_len != q_len:  # the layers write another span than planned: plan it again
            step.pos, step.q_len, step.end = pos, q_len, pos + q_len
            self.book.masks = {}
            for layer in self._planners:
                layer.begin(step)
        return step

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor,
              queries: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``(B, kv_heads, q_len, hd)`` for positions ``pos..pos+q_len-1`` of ``layer`` and
        return the keys/values its attention must read (in ``cache.inspect.read_positions`` order; :meth:`mask` gives
        their mask). ``queries`` (after RoPE): for a press that reads them. A shared layer: :meth:`read_shared`."""
        step = self._step_for(pos, k.shape[2])
        if queries is not None:
            self._note_queries(layer, queries)
        c = step.counters
        written, copied = c.written_bytes, c.copied_bytes
        with self.book.window:  # what the allocator does inside the cache's own write, and nothing else
            out = self.layers[layer].write(step, k, v)
        self.book.moved[layer] = (c.written_bytes - written, c.copied_bytes - copied)
        if layer in self._sources:
            step.reads[layer] = out
        return out

    def read_shared(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a shared layer reads: what its source layer's attention read this step."""
        spec = self.plan[layer]
        if not spec.shares:
            raise SettingsError(f"layer {layer} stores its own cache ({spec.kind}); write it with write()")
        return self.layers[layer].read(self.book.step)

    def note_reads(self, layer: int, positions: torch.Tensor | list[int], copied_bytes: int) -> None:
        """A layer's attention read only ``positions`` (gathered into ``copied_bytes`` of temporaries): what
        ``cache.inspect.read_positions`` reports for it until the next step (DeepSeek-V3.2's sparse attention). A tensor
        of positions stays where it is until someone asks."""
        book = self.book
        book.reads[layer] = positions
        book.counters.temporaries(copied_bytes)
        written, copied = book.moved.get(layer, (0, 0))
        book.moved[layer] = (written, copied + copied_bytes)

    def mask(self, layer: int, pos: int, q_len: int) -> torch.Tensor | None:
        """The boolean ``(q_len, keys)`` mask for what ``write`` (or ``read_shared``) returned for ``layer`` this
        step, or ``(batch, kv_heads, q_len, keys)`` when each KV head reads its own keys (a pressed layer), or None when
        plain causal attention is exact. Built once per step per mask group."""
        target = self.layers[layer]
        group = target.groups().mask
        masks = self.book.masks
        if group not in masks:
            masks[group] = target.mask(self._step_for(pos, q_len))
        return masks[group]

    def commit(self, end: int) -> None:
        """Record that every layer now holds positions ``0..end-1`` (called once per forward pass)."""
        self._length = end
        step = self.book.step
        if step is not None and not step.committed:
            for layer in self._committers:
                layer.commit(step)
            step.committed = True
        self.book.report = make_report(self)

    def settle(self) -> None:
        """Forget how to undo the last step: from here on :meth:`rollback` does nothing until a step begins. What
        the journal kept alive is freed now (a concatenating cache's old storage): the step's report counts it."""
        book = self.book
        journal = book.journal
        window = Window(self.allocator if journal is not None else None)
        with window:
            book.forget_step()  # the step held the journal, its reads and its masks (read by its forward pass only)
            if had_step := journal is not None:
                journal.trim()
                del journal
        if (report := book.report) is not None:
            for name, n in window.figures().items():
                report.cuda[name] = report.cuda.get(name, 0) + n
        if had_step:
            report_again(self)

    def rollback(self) -> None:
        """Undo the last step (written or committed) exactly: length, slots, memory report, held keys and values.
        Does nothing when there is no step to undo (none began, or it was already rolled back)."""
        book = self.book
        if book.journal is None:
            return
        book.journal.undo()
        book.journal.trim_back()
        self._length, figures = book.saved
        book.restore(figures)
        book.forget_step()
        report_again(self, walk=True)

    @contextmanager
    def checkpointing_states(self) -> Iterator[None]:
        """Inside: linear-attention layers compute token by token and hand the state after each position to the
        cache (``cache.states.checkpointing``), so a cut restores one of them; after: as before."""
        before, self._checkpointing = self._checkpointing, True
        try:
            yield
        finally:
            self._checkpointing = before

    # -- rewinds -----------------------------------------------------------------------------------------------
    def check_truncate(self, n: int, rings: bool = True) -> None:
        """Raise, changing nothing, if the cache cannot be truncated to ``n`` positions (so several caches can be
        checked before any is rewound). ``rings=False``: check only what the strategy itself allows."""
        if not 0 <= n <= self.length:
            raise SettingsError(f"cannot truncate to {n}: the cache holds {self.length} positions "
                                f"(0 <= n <= {self.length})")
        if rings and (msg := self.inspect.replay_error(n)):
            raise SettingsError(f"cannot truncate to {n}: {msg}")
        for layer in self.layers:
            if msg := layer.take_back(n, self.length).truncate:
                raise SettingsError(msg)

    def truncate(self, n: int) -> None:
        """Rewind: keep only the first ``n`` positions. Storage is not cleared; the length moves back."""
        self.check_truncate(n)
        length = self._length
        self._length = n
        book = self.book
        book.restore((StepCounters(), None, book.window, {}, {}))
        book.forget_step()
        for layer in self.layers:
            layer.truncate(n, length, book.counters)

    # -- copies ------------------------------------------------------------------------------------------------
    def _copy(self, fork: bool) -> "KVCache":
        """A copy whose layers are ``layer.clone(memo, fork)`` (a structure layers share: copied once, shared)."""
        twin = shallow_copy(self)
        memo: dict[int, object] = {}
        twin.layers = []
        for layer in self.layers:
            copy = layer.clone(memo, fork)
            memo[id(layer)] = copy
            twin.layers.append(copy)
        twin._index()
        twin.book = self.book.twin()
        if (report := self.book.report) is not None:  # its own report: settle() adds to a report's allocator figures
            twin.book.report = replace(report, cuda=dict(report.cuda))
            report_again(twin, walk=True)
        return twin

    def clone(self) -> "KVCache":
        """An independent copy: writes to either never show in the other."""
        return self._copy(False)

    def fork(self) -> "KVCache":
        """A cache for a second sequence continuing from this one's prefix. By default an independent copy;
        strategies that can share storage (the paged cache) share it until the sequences diverge."""
        if self.length == 0:
            raise SettingsError(f"cannot fork an empty {type(self).__name__}: there is no prefix to share; "
                                f"make a new cache instead")
        return self._copy(True)

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else self.capacity
        inspect = self.inspect
        return (f"{type(self).__name__}(length={self.length}, capacity={cap}, batch_size={self.batch_size}, "
                f"dtype={self.dtype}, device={self.device}, reserved={inspect.reserved_bytes} B, "
                f"layers: {inspect.describe_layers()})")


class States:
    """The linear-attention layers of a cache (``cache.states``): each keeps a fixed state, read and replaced whole
    by its layer's forward pass (see :mod:`kvexplore.caches.layers.state`)."""

    def __init__(self, cache: KVCache, layers: dict[int, LayerCache]) -> None:
        self.cache, self.layers = cache, layers

    @property
    def checkpointing(self) -> bool:
        """True inside ``cache.checkpointing_states()`` (a verification pass): the layers then compute token by
        token and hand over the state after each position (``write(..., checkpoints=)``)."""
        return self.cache._checkpointing

    def read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s state: its convolution's last inputs and its recurrent matrix."""
        return self._layer(layer).read_state()

    def write(self, layer: int, conv: torch.Tensor, recurrent: torch.Tensor, checkpoints=None) -> None:
        """Replace ``layer``'s state in place; ``checkpoints``: the state after each of the step's positions."""
        target, cache = self._layer(layer), self.cache
        step = cache.book.step
        if step is None or step.committed:
            step = cache._start(cache._length, 0, None)
        before = step.counters.written_bytes
        with cache.book.window:
            target.write_state(step, conv, recurrent, checkpoints)
        cache.book.moved[layer] = (step.counters.written_bytes - before, 0)

    def layer_bytes(self, layer: int) -> int:
        return self._layer(layer).memory(self.cache.length).reserved_bytes

    def _layer(self, layer: int) -> LayerCache:
        if layer not in self.layers:
            raise SettingsError(f"layer {layer} is not a linear-attention layer; it has no state (those that do: "
                                f"{sorted(self.layers)})")
        return self.layers[layer]
