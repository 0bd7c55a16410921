"""The model-level cache protocol: what the generator, a tracer and the views ask of any cache. Two families
implement it by subclassing :class:`ModelCache` (an ABC: a missing method fails at construction):
:class:`~kvexplore.caches.base.KVCache`, kvexplore's own, and :class:`~kvexplore.hf.cache.HFCache`, a transformers
``Cache`` watched after every step (``hf:...``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

import torch

from .memory import MemoryReport
from .slots import SlotView


class Eviction(Protocol):
    """What a cache that evicts by scores answers (:attr:`ModelCache.eviction`; kvexplore's ``evict`` cache): per KV
    head, the positions kept, where each is rotated and what each head read; the last press's scores; the presses so
    far; the press and its plan (``pressplan.decode_every``: presses while decoding)."""

    press: Any
    pressplan: Any

    def kept_positions(self, layer: int, batch: int = 0) -> list[list[int]]: ...

    def rope_positions(self, layer: int, batch: int = 0) -> list[list[int]]: ...

    def read_positions_by_head(self, layer: int, batch: int = 0) -> list[list[int]]: ...

    def kept_mask(self, layer: int, batch: int = 0) -> torch.Tensor: ...

    def press_scores(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    @property
    def press_events(self) -> list: ...

    def held_counts(self, layer: int, batch: int = 0) -> tuple[int, ...]: ...

    def reads_queries(self, layer: int) -> bool:
        """Whether ``layer``'s press reads its queries (hand them to ``cache.write(..., queries=q)``)."""


class Quantization(Protocol):
    """What a cache that stores keys and values lossily by design answers (:attr:`ModelCache.quantization`): how
    far what it stores for ``layer`` is from what the model wrote, per position and per channel, the codes of each
    channel's worst block, and how far a correct cache of its kind may be off (what the doctor judges it by). Every
    answer is None for a layer it keeps exact, and where it keeps no record."""

    def stored_error(self, layer: int) -> torch.Tensor | None:
        """``(kv_heads, length)`` max absolute error per position, on the CPU, first sequence of the batch."""

    def channel_error(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The keys' and the values' max absolute error per KV head and channel, ``(kv_heads, head_dim)`` each."""

    def channel_detail(self, layer: int) -> tuple[Any, Any] | None:
        """The keys' and values' channels as stored: each channel's largest magnitude as written and the codes,
        scales and zero points of its worst block (:class:`~kvexplore.caches.channel_detail.PartDetail`)."""

    def error_bound(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple | None:
        """Element by element, how far a correct cache of this kind may give attention something other than the
        model's ``keys`` and ``values`` ``(kv_heads, positions, head_dim)`` of the sequence so far."""


class CacheInspector(Protocol):
    """What every cache's ``inspect`` answers (kvexplore's :class:`~kvexplore.caches.inspector.Inspector` adds the
    per-layer questions of a cache made of layer caches)."""

    def memory_report(self) -> MemoryReport:
        """Memory after the last step."""

    def slot_view(self, layer: int | None = None) -> SlotView:
        """The state of every physical slot of ``layer``."""

    def slot_views(self) -> list[SlotView]:
        """:meth:`slot_view` of every layer."""

    def storage(self, layer: int) -> list[torch.Tensor]:
        """The tensors that hold ``layer``'s cache."""

    def read_positions(self, layer: int | None = None) -> list[int]:
        """The position of each key column ``layer``'s attention read in the last step."""

    def read_window(self, layer: int, count: int) -> tuple[int, int]:
        """``(first position, count)`` of what ``layer``'s attention reads in the step under way."""

    def read_group(self, layer: int) -> tuple:
        """Layers with the same group read the same positions in a step."""

    def pending_reads(self) -> dict[int, torch.Tensor]:
        """Reads of this step still on the device (layer -> positions)."""

    def land_reads(self, landed: dict[int, torch.Tensor]) -> None:
        """Replace pending reads by their host copies."""

    def describe_layers(self) -> str:
        """What the cache keeps for each kind of layer, in one line."""

    def what_it_did(self) -> str:
        """What a lossy cache did to the sequence so far, in one line; "" for an exact one."""

    def crop_error(self, n: int) -> str | None:
        """Why cutting the last step back to ``n`` positions would not leave the cache as a step that wrote only up to
        ``n`` would (None: ``truncate(n)`` does)."""

    def speculation_refusal(self) -> str | None:
        """Why a drafting generator cannot run on this cache (None: it can)."""

    def needs_replay(self, n: int) -> bool:
        """Whether going back to ``n`` needs the kept tokens recomputed (the generator replays them)."""

    @property
    def reserved_bytes(self) -> int:
        """Bytes of storage held now, used or not."""

    @property
    def held(self) -> int:
        """Positions a full layer holds."""

    @property
    def evicts_on_write(self) -> bool:
        """Whether the cache drops positions as it writes, without a press."""


class ModelCache(ABC):
    """A model's cache as the generator, the tracer and the views see it: the step, rewinds, copies, and three
    facets (``inspect``: what it can say about itself; ``eviction`` and ``quantization``: what a lossy one did).
    Attributes every implementation has: ``kind`` (its name), ``config``, ``plan`` (one
    :class:`~kvexplore.config.layer_plan.LayerSpec` per layer), ``batch_size``, ``dtype``, ``device``, ``length``,
    ``capacity`` (None: unbounded), ``full_layers``."""

    stores = True  # keeps keys and values between steps (a cache that stores nothing recomputes every step)

    # -- a step ---------------------------------------------------------------------------------------------
    @abstractmethod
    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        """Raise, changing nothing, if ``q_len`` positions cannot be written at ``pos``."""

    @abstractmethod
    def begin_step(self, pos: int, q_len: int, model: Any = None) -> None:
        """A pass of ``model`` writing ``q_len`` positions at ``pos`` starts: keep what :meth:`rollback` needs."""

    @abstractmethod
    def settle(self) -> None:
        """Forget how to undo the last step."""

    @abstractmethod
    def rollback(self) -> None:
        """Undo the last step exactly (nothing when there is none)."""

    def checkpointing_states(self) -> AbstractContextManager:
        """A context inside which a verification pass hands linear-attention layers the state after each position
        it feeds, so a cut restores one of them (nothing to do for a cache without such layers)."""
        return nullcontext()

    # -- rewinds and copies ------------------------------------------------------------------------------
    @abstractmethod
    def check_truncate(self, n: int, rings: bool = True) -> None:
        """Raise, changing nothing, if the cache cannot go back to ``n`` positions."""

    @abstractmethod
    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` positions."""

    @abstractmethod
    def clone(self) -> "ModelCache":
        """An independent copy."""

    @abstractmethod
    def fork(self) -> "ModelCache":
        """A cache for a second sequence continuing this one."""

    # -- facets ----------------------------------------------------------------------------------------------
    @property
    @abstractmethod
    def inspect(self) -> CacheInspector:
        """What the cache can say about itself (see :class:`CacheInspector`)."""

    @property
    def eviction(self) -> Eviction | None:
        """The cache's eviction by scores (see :class:`Eviction`); None for a cache that does not press."""
        return None

    @property
    def quantization(self) -> Quantization | None:
        """The cache's lossy storage (see :class:`Quantization`); None for a cache that stores what the model wrote."""
        return None
