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


class TakeBack(NamedTuple):
    """What going back from ``length`` to ``n`` positions means for one layer (each None where it can)."""

    #: why it cannot, although recomputing the kept tokens would rebuild it (a ring that wrapped, a recurrent state)
    replay: str | None
    #: why it cannot at all (positions it dropped for good)
    truncate: str | None
    #: why cutting the step just written back to ``n`` would not leave it as a step that wrote only up to ``n``
    #: (speculative decoding then rolls the step back and writes the accepted tokens again)
    crop: str | None
    #: how taking drafted positions back looks in this layer, in words (the views and notebook 12 show it)
    way: str


class Positions:
    """The positions a layer holds and reads when the sequence has ``length``; each answer is computed when asked."""

    __slots__ = ("_layer", "_length")

    def __init__(self, layer: "LayerCache", length: int) -> None:
        self._layer, self._length = layer, length

    @property
    def count(self) -> int:
        """How many positions it holds (a pressed layer: the most one KV head holds)."""
        return self._layer._held(self._length)

    @property
    def held(self) -> list[int]:
        """The positions it holds, oldest first (none for a shared or recurrent layer)."""
        return self._layer._held_positions(self._length)

    @property
    def read(self) -> list[int]:
        """Position of each key column the last step's attention read, in the order it saw them."""
        return self._layer._read_positions(self._length)

    @property
    def start(self) -> int:
        """First position attention reads in the step under way (a ring reads its window)."""
        return self._layer._read_start()

    def slots(self, head: int | None = None) -> SlotView:
        """Where each sits: the state of every physical slot (what the cache map draws); ``head``: one KV head's,
        for a layer whose heads keep different positions (a pressed layer; default: head 0's)."""
        if head is None:
            return self._layer._slot_view(self._length)
        return self._layer._slot_view(self._length, head=head)


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

    # -- going back ---------------------------------------------------------------------------------------------
    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        """Keep positions ``0..n-1`` (checked before: :meth:`take_back`); ``counters`` count what it frees."""

    def take_back(self, n: int, length: int) -> "TakeBack":
        """What going back from ``length`` to ``n`` positions means for this layer (:class:`TakeBack`), from the hooks
        :meth:`_replay_error`, :meth:`_truncate_error`, :meth:`_crop_error` and :attr:`_crop_way`."""
        replay, truncate = self._replay_error(n, length), self._truncate_error(n, length)
        return TakeBack(replay, truncate, self._crop_error(n, length) or replay or truncate, self._crop_way)

    def _replay_error(self, n: int, length: int) -> str | None:
        """:attr:`TakeBack.replay` (default None)."""
        return None

    def _truncate_error(self, n: int, length: int) -> str | None:
        """:attr:`TakeBack.truncate` (default None)."""
        return None

    def _crop_error(self, n: int, length: int) -> str | None:
        """What else stops a cut of the step just written (:attr:`TakeBack.crop` is this, else the replay or the
        truncate answer; default None: :meth:`truncate` does it)."""
        return None

    #: :attr:`TakeBack.way`
    _crop_way = "the drafted slots past the kept length are left stale: nothing is copied or freed"

    # -- copies ---------------------------------------------------------------------------------------------
    @abstractmethod
    def clone(self, memo: dict[int, Any], fork: bool = False) -> "LayerCache":
        """An independent copy. ``memo`` maps ``id`` of a structure shared by several layers to its copy, so the
        copies share one copy of it as the originals share it. ``fork``: a copy for a second sequence continuing
        this one (a paged layer shares its pool; the others copy as for a clone)."""

    # -- inspection -----------------------------------------------------------------------------------------
    def positions(self, length: int) -> "Positions":
        """Which positions this layer holds and reads when the sequence has ``length``, and where each sits
        (:class:`Positions`: each answer computed when asked, from the hooks :meth:`_held`, :meth:`_held_positions`,
        :meth:`_read_positions`, :meth:`_read_start` and :meth:`_slot_view`)."""
        return Positions(self, length)

    def _held(self, length: int) -> int:
        """:attr:`Positions.count` (default: ``length``)."""
        return length

    def _held_positions(self, length: int) -> list[int]:
        """:attr:`Positions.held` (a full layer: all of them)."""
        return list(range(length))

    def _read_positions(self, length: int) -> list[int]:
        """:attr:`Positions.read` (a full layer: all of them)."""
        return list(range(length))

    def _read_start(self) -> int:
        """:attr:`Positions.start` (a full layer: 0)."""
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
        return layer_bytes(self.spec, self._held(length), self._batch, self._dtype)

    _analytic_bytes = _used_bytes

    def memory(self, length: int, written: int = 0, copied: int = 0, held_bytes: int = 0,
               parts: dict[str, int] | None = None) -> LayerMemory:
        """This layer's :class:`LayerMemory` after a step that wrote and copied those bytes (``held_bytes`` and
        ``parts``: what a walk of the storage reachable from it found)."""
        return LayerMemory(self.spec.index, self.spec.kind, self._held(length), self._used_bytes(length),
                           self._reserved_bytes(), self._analytic_bytes(length), written, copied, held_bytes,
                           {} if parts is None else parts)

    @abstractmethod
    def _slot_view(self, length: int) -> SlotView:
        """:meth:`Positions.slots`."""

    def describe(self, count: int, strategy: str, config: ModelConfig) -> str:
        """One phrase for ``count`` layers like this one, in a cache of ``strategy`` (``describe_layers()``)."""
        return f"{count} {self.spec.kind} layer{'s' * (count != 1)}"

    #: how the memory report names what this layer holds: ``""``, what :meth:`storage` holds (keys and values when
    #: not listed), else by attribute (an attribute not listed is named as it is spelled; see
    #: :mod:`kvexplore.caches.held`)
    _held_names: dict[str, str] = {}

    # the batch and dtype the byte formulas use: set by the classes that store tensors
    _batch: int = 1
    _dtype: torch.dtype = torch.float32


_LABELS: dict[tuple[type, str], str] = {}


def held_label(layer: LayerCache, attribute: str) -> str:
    """What the memory report calls ``layer``'s ``attribute``: its class's ``_held_names`` entry, else the attribute's
    name without its underscore; ``""`` is what :meth:`~LayerCache.storage` holds (keys and values unless named)."""
    key = (type(layer), attribute)
    label = _LABELS.get(key)
    if label is None:
        bare = attribute.lstrip("_")
        label = _LABELS[key] = layer._held_names.get(bare) or bare or "keys and values"
    return label


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
