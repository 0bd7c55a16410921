"""The protocol of one layer's cache, and the step every layer of a forward pass sees (docs/extending.md, "The layer
protocol"). Which class serves a layer is decided by the layer-kind registry (:mod:`kvexplore.caches.registry`); the
container calls only the methods below and never compares kinds.

Layout: keys and values are ``[batch, kv_heads, seq, width]`` and keys are stored *after* RoPE. A latent layer (MLA,
``spec.latent``) stores its latent in the keys' place and its rope key in the values' place
(:attr:`LayerCache._widths`); a strategy that cannot store two widths refuses latent layers (``refuses(spec)``).
Everything a step changes in place is recorded in ``step.journal``, so a failed or rolled-back step is put back exactly;
structures several layers share (a pool, block tables, a slot map) plan once per step."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

from ..config.layer_plan import LayerSpec
from ..config.model_config import ModelConfig
from .journal import NoJournal, UndoJournal
from .masks import causal_mask
from .memory import LayerMemory, StepCounters, layer_bytes
from .slots import SlotView


_SERIALS = itertools.count()


def shallow_copy(obj: Any, cls: type | None = None) -> Any:
    """A new ``cls`` (default: ``obj``'s class) sharing ``obj``'s attributes, made without ``__init__``."""
    twin = object.__new__(cls or type(obj))
    twin.__dict__.update(obj.__dict__)
    return twin


class Groups(NamedTuple):
    """Layers with the same ``read`` read the same positions in a step (the tracer records one list each), those with
    the same ``view`` have the same slot view (one object serves them all), those with the same ``mask`` get the same
    mask in a step (built once)."""

    read: tuple
    view: tuple
    mask: tuple


class Step:
    """One forward pass as the layers see it: it writes ``q_len`` positions at ``pos`` (``end = pos + q_len``) into
    a cache that held ``length`` positions; ``counters`` sum its bytes, ``journal`` records how to undo it,
    ``reads`` keeps what each source layer's attention read (for the layers that share it)."""

    __slots__ = ("pos", "q_len", "end", "length", "device", "counters", "journal", "reads", "committed", "serial")

    def __init__(self, pos: int, q_len: int, length: int, device: torch.device,
                 journal: UndoJournal | None = None) -> None:
        self.pos, self.q_len, self.end, self.length, self.device = pos, q_len, pos + q_len, length, device
        self.counters = StepCounters()
        self.journal = NoJournal() if journal is None else journal
        self.reads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.committed = False
        self.serial = next(_SERIALS)  # what a structure planning once per step remembers (never the step itself)


class LayerCache(ABC):
    """One layer's cache (see the module docstring). ``spec`` is the layer's entry of the plan."""

    def __init__(self, spec: LayerSpec) -> None:
        self.spec = spec

    # -- what it stores -----------------------------------------------------------------------------------
    @property
    def _widths(self) -> tuple[int, int]:
        """Widths of the two stored tensors per position: keys and values (a latent layer: latent, rope key)."""
        return self.spec.head_dim, self.spec.value_width

    # -- a step -------------------------------------------------------------------------------------------
    def begin(self, step: Step) -> None:
        """Plan ``step`` before any layer writes (and record in ``step.journal`` the bookkeeping it will change)."""

    @abstractmethod
    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``(B, kv_heads, q_len, width)`` for the step's positions and return what attention
        reads ``(B, kv_heads, keys, width)``, in the order :meth:`read_positions` gives."""

    def mask(self, step: Step) -> torch.Tensor | None:
        """The boolean ``(q_len, keys)`` mask for what :meth:`write` returned (None: plain causal is exact)."""
        return causal_mask(step.pos, step.q_len, None, step.device)

    def groups(self) -> "Groups":
        """Which layers this one reads, draws and masks alike (:class:`Groups`): by default by attention type (reads,
        mask) and kind (slot view); a layer whose reads are its own (a pressed layer) or another's (shared) says so."""
        return Groups((self.spec.attends, -1), (self.spec.kind, -1), (self.spec.attends,))

    def commit(self, step: Step) -> None:
        """The step's positions are now part of the sequence (its writes all succeeded)."""

    # -- rewinds --------------------------------------------------------------------------------------------
    def replay_error(self, n: int, length: int) -> str | None:
        """Why this layer cannot go back from ``length`` to ``n`` positions although recomputing the kept tokens
        would rebuild it (a ring that wrapped, a recurrent state); None when it can."""
        return None

    def truncate_error(self, n: int, length: int) -> str | None:
        """Why this layer cannot go back to ``n`` at all (positions it dropped for good); None when it can."""
        return None

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        """Keep positions ``0..n-1`` (checked before); ``counters`` count what it frees."""

    # -- speculative decoding: taking rejected drafts back ------------------------------------------------------
    #: how taking drafted positions back looks in this layer, in words (the views and notebook 12 show it)
    crop_way = "the drafted slots past the kept length are left stale: nothing is copied or freed"

    def crop_error(self, n: int, length: int) -> str | None:
        """Why cutting the step just written (the cache now at ``length``) back to ``n`` positions would not leave
        this layer as a step that wrote only up to ``n`` would (None: :meth:`truncate` does); speculative decoding then
        rolls the step back and writes the accepted tokens again."""
        return self.replay_error(n, length) or self.truncate_error(n, length)

    # -- copies ---------------------------------------------------------------------------------------------
    @abstractmethod
    def clone(self, memo: dict[int, Any]) -> "LayerCache":
        """An independent copy. ``memo`` maps ``id`` of a structure shared by several layers to its copy, so the
        copies share one copy of it as the originals share it."""

    def fork(self, memo: dict[int, Any]) -> "LayerCache":
        """A copy for a second sequence continuing this one (a paged layer shares its pool); default: a clone."""
        return self.clone(memo)

    # -- inspection -----------------------------------------------------------------------------------------
    def held(self, length: int) -> int:
        """How many positions this layer holds when the sequence has ``length`` positions."""
        return length

    def held_positions(self, length: int) -> list[int]:
        """The positions this layer holds, oldest first (a full layer: all of them)."""
        return list(range(length))

    def read_positions(self, length: int) -> list[int]:
        """Position of each key column the last step's attention read, in the order it saw them."""
        return list(range(length))

    def read_start(self) -> int:
        """First position attention reads in the step under way (a ring reads its window)."""
        return 0

    @abstractmethod
    def storage(self) -> list[torch.Tensor]:
        """The tensors that hold this layer's cache (a read that shares their memory is a view, not a copy)."""

    def _reserved_bytes(self) -> int:
        """Bytes of this layer's storage, used or not (each storage counted once)."""
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.storage()}
        return sum(seen.values())

    def _used_bytes(self, length: int) -> int:
        """Bytes of the slots holding valid positions; by default also :meth:`_analytic_bytes`, the formula
        ``2 * kv_heads * head_dim * element_size * batch * held`` for this layer."""
        return layer_bytes(self.spec, self.held(length), self._batch, self._dtype)

    _analytic_bytes = _used_bytes

    def memory(self, length: int, written: int = 0, copied: int = 0, held_bytes: int = 0,
               parts: dict[str, int] | None = None) -> LayerMemory:
        """This layer's :class:`LayerMemory` after a step that wrote and copied those bytes (``held_bytes`` and
        ``parts``: what a walk of the storage reachable from it found)."""
        return LayerMemory(self.spec.index, self.spec.kind, self.held(length), self._used_bytes(length),
                           self._reserved_bytes(), self._analytic_bytes(length), written, copied, held_bytes,
                           {} if parts is None else parts)

    @abstractmethod
    def slot_view(self, length: int) -> SlotView:
        """The state of every physical slot (what the cache map draws)."""

    def describe(self, count: int, strategy: str, config: ModelConfig) -> str:
        """One phrase for ``count`` layers like this one, in a cache of ``strategy``."""
        return f"{count} {self.spec.kind} layer{'s' * (count != 1)}"

    #: how the memory report names what this layer holds: ``""``, what :meth:`storage` holds (keys and values when
    #: not listed), else by attribute (an attribute not listed is named as it is spelled; see
    #: :mod:`kvexplore.caches.held`)
    held_names: dict[str, str] = {}

    # the batch and dtype the byte formulas use: set by the classes that store tensors
    _batch: int = 1
    _dtype: torch.dtype = torch.float32


class StoredLayer(LayerCache):
    """A layer cache that holds tensors of its own: remembers the batch, dtype and device they are made with."""

    def __init__(self, spec: LayerSpec, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec)
        self._batch, self._dtype, self.device = batch_size, dtype, device

    def shape(self, slots: int, values: bool = False) -> tuple[int, int, int, int]:
        """``(batch, kv_heads, slots, width)`` of the key storage (``values``: the value storage)."""
        return (self._batch, self.spec.kv_heads, slots, self._widths[1] if values else self._widths[0])

    def zeros(self, slots: int, values: bool = False) -> torch.Tensor:
        return torch.zeros(self.shape(slots, values), dtype=self._dtype, device=self.device)


class FullLayer(StoredLayer):
    """A full-attention layer of a strategy: every position (unless the strategy evicts), read from position 0."""

    #: a sliding-window layer the strategy keeps whole (every position in its storage, each query reading only its
    #: window: ``cache.keeps_windows_whole``, a prefix pool's pages); None: a full layer
    window: int | None = None

    def mask(self, step: Step) -> torch.Tensor | None:
        return causal_mask(step.pos, step.q_len, self.window, step.device)

    def describe(self, count: int, strategy: str, config: ModelConfig) -> str:
        return full_phrase(self.spec, count, strategy, config)


def full_phrase(spec: LayerSpec, count: int, strategy: str, config: ModelConfig) -> str:
    """``count`` full layers like ``spec`` served by ``strategy``, in words (a latent layer says what it stores)."""
    what = ""
    if spec.latent:
        index = config.index_head_dim if config.index_topk else 0
        what = f" (latent {spec.head_dim} + rope key {spec.value_width - index}" + (
            f" + indexer key {index}" if index else "") + " per position)"
    return f"{count} full layer{'s' * (count != 1)}{what}: {strategy}"
