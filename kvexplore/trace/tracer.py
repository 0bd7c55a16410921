"""Tracing: what each generation step did inside the cache and the attention, recorded as host copies: a
:class:`Tracer` gives every :class:`~kvexplore.StepRecord` a :class:`StepTrace` (what ``capture`` can hold:
docs/tracing.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
import torch

from ..caches.base import KVCache, SlotView
from ..caches.layout import SharedLayout
from ..errors import SettingsError
from ..core import host
from .later import built_later
from .press import PressOutcome, PressStep, record as press_record
from .ranks import RankStep

CAPTURES = frozenset({"cache", "attention", "qkv", "memory", "timing"})


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """What one layer's attention did with the cache in one forward pass (plain values: copies by nature)."""

    layer: int
    write: tuple[int, int]  # (first position, count) written
    read: tuple[int, int]  # (first position, count) of the positions attention read (logical)
    read_shape: tuple[int, ...]
    data_ptr: int  # of the keys attention read
    storage_offset: int
    stride: tuple[int, ...]
    view: bool  # the keys read share the cache's storage (no copy was made to read them)


class AttentionHistory:
    """One growing float32 buffer for a run's captured attention rows; entries are (offset, shape, first query
    position)."""

    bounded = False  # every row recorded is kept (an explorer lane's store keeps a binned overview and the newest rows)

    def __init__(self) -> None:
        self._buf = torch.empty(0)
        self._used = 0

    def append(self, t: torch.Tensor, first: int = 0) -> tuple[int, tuple[int, ...], int]:
        flat = t.detach().reshape(-1).float()  # a host copy (Tracer.later brought it over)
        need = self._used + flat.numel()
        if need > self._buf.numel():  # grow by a quarter: resident memory stays close to what is held
            grown = torch.empty(max(need, int(self._buf.numel() * 1.25), 1 << 16))
            grown[: self._used] = self._buf[: self._used]
            self._buf = grown
        self._buf[self._used:need] = flat
        entry = (self._used, tuple(t.shape), first)
        self._used = need
        return entry

    def holds(self, entry) -> bool:
        return True  # everything recorded is kept

    def get(self, entry: tuple[int, tuple[int, ...], int], reads=None) -> torch.Tensor:
        offset, shape, _ = entry
        return self._buf[offset: offset + torch.Size(shape).numel()].view(shape)

    def clip(self, entry: tuple[int, tuple[int, ...], int], n: int) -> tuple[int, tuple[int, ...], int]:
        """The entry's rows of query positions below ``n`` (the first rows: still one piece of the buffer)."""
        offset, shape, first = entry
        return offset, (max(0, min(shape[0], n - first)), *shape[1:]), first

    @property
    def nbytes(self) -> int:
        return self._used * 4

    @property
    def reserved_bytes(self) -> int:
        return self._buf.numel() * 4


@built_later("events", "layer_slots", "layer_reads")
@dataclass
class StepTrace:
    """The trace of one step (its attention rows live in the run's :class:`AttentionHistory`). ``layer_slots[i]`` is
    layer ``i``'s slot view after the step and ``layer_reads[i]`` the positions its attention read (layers that look
    the same share one object); ``slots`` and ``read_positions`` are those of ``main_layer``, the first full layer."""

    events: list[CacheEvent] = field(default_factory=list)
    layer_slots: list[SlotView] = field(default_factory=list)
    layer_reads: list[list[int]] = field(default_factory=list)
    main_layer: int = 0
    gqa_groups: list[list[int]] = field(default_factory=list)  # query heads reading each kv head
    heads: list[int] = field(default_factory=list)  # the query heads recorded
    qkv: dict[str, torch.Tensor] = field(default_factory=dict)
    press: PressStep | None = None  # a pressing cache's state after the step (with "cache"; see .press)
    ranks: RankStep | None = None  # a lane over several processes: every rank after the step's pass (see .ranks)
    _attention: dict[int, tuple] = field(default_factory=dict)  # layer -> where its rows are in the history
    _history: Any = None  # the run's AttentionHistory, or the explorer lane's AttentionStore

    @property
    def history(self) -> Any:
        """Where this step's attention rows are kept: the run's :class:`AttentionHistory`, or the explorer lane's
        :class:`~kvexplore.explorer.attention_store.AttentionStore`."""
        return self._history

    @property
    def entries(self) -> dict[int, Any]:
        """Layer -> where its rows of this step are in :attr:`history` (what :meth:`keep_attention` recorded)."""
        return self._attention

    def keep_attention(self, layer: int, entry: Any) -> None:
        """Record that ``layer``'s rows of this step are ``entry`` in :attr:`history`."""
        self._attention[layer] = entry

    def adopt_attention(self, source: "StepTrace", history: Any) -> None:
        """This step's attention is ``source``'s (a pass that computed the same), its rows kept in ``history`` (a copy
        of where ``source``'s are)."""
        self._history = history
        self._attention = dict(source._attention)

    def truncate(self, n: int) -> None:
        """Keep the attention rows of query positions below ``n`` only (a speculative take-back cut the rest)."""
        self._attention = {layer: self._history.clip(entry, n) for layer, entry in self._attention.items()}

    @property
    def slots(self) -> SlotView | None:
        """The slot view of the main layer (see :meth:`slots_of` for any layer), None without ``"cache"``."""
        return self.slots_of(self.main_layer) if self.layer_slots else None

    @property
    def read_positions(self) -> list[int]:
        """The positions the main layer's attention read (see :meth:`reads_of`)."""
        return self.reads_of(self.main_layer)

    def slots_of(self, layer: int) -> SlotView | None:
        """Layer ``layer``'s slot view after the step (a trace of one view serves every layer)."""
        if not self.layer_slots:
            return None
        return self.layer_slots[layer if len(self.layer_slots) > 1 else 0]

    def reads_of(self, layer: int) -> list[int]:
        """The position of each key column layer ``layer``'s attention read, in the order it read them."""
        if not self.layer_reads:
            return []
        return self.layer_reads[layer if len(self.layer_reads) > 1 else 0]

    def has_attention(self, layer: int) -> bool:
        """Whether the attention of ``layer`` was recorded (and is still held: the explorer keeps the rows of its
        recent steps only, see :class:`~kvexplore.explorer.attention_store.AttentionStore`)."""
        return layer in self._attention and self._history.holds(self._attention[layer])

    @property
    def attention_layers(self) -> list[int]:
        return sorted(self._attention)

    def attention_raw(self, layer: int) -> torch.Tensor:
        """``(T, heads, S)``: the new tokens' probabilities over the key columns in the order attention read them."""
        return self._history.get(self._attention[layer], self.reads_of(layer))

    def attention(self, layer: int) -> torch.Tensor:
        """``(T, heads, max position + 1)`` in logical position order (0 where a position was not read)."""
        raw, reads = self.attention_raw(layer), self.reads_of(layer)
        out = raw.new_zeros(*raw.shape[:2], max(reads) + 1)
        out[..., reads] = raw
        return out

    def physical_attention(self, layer: int) -> torch.Tensor:
        """``(T, heads, slots)`` in the cache's physical slot order (needs ``"cache"`` capture for the slot map);
        positions the step read that the cache no longer holds after it have no slot and are left out."""
        slots = self.slots_of(layer)
        if slots is None:
            raise SettingsError("physical order needs the slot view: trace with capture including 'cache'")
        if isinstance(slots.layout, SharedLayout):  # a shared layer read its source's slots
            slots = self.slots_of(slots.layout.source)
        slot_of = {p: s for s, p in enumerate(slots.positions) if p >= 0}
        raw = self.attention_raw(layer)
        out = raw.new_zeros(*raw.shape[:2], len(slots.positions))
        # a position read in the step may be gone by its end (a prompt longer than a sliding layer's ring is read
        # whole, then only its last `window` positions are kept): it has no slot, so no column here
        kept = [(i, slot_of[p]) for i, p in enumerate(self.reads_of(layer)) if p in slot_of]
        if kept:
            columns, slots_at = zip(*kept)
            out[..., list(slots_at)] = raw[..., list(columns)]
        return out


class Tracer:
    """Records what :class:`~kvexplore.Generator` steps do; pass it as ``Generator(..., tracer=...)``."""

    def __init__(self, capture: set[str] | frozenset[str] = frozenset({"cache", "memory", "timing"}),
                 layers: list[int] | None = None, heads: list[int] | None = None) -> None:
        if unknown := set(capture) - CAPTURES:
            raise SettingsError(f"unknown capture {sorted(unknown)}; choose from {sorted(CAPTURES)}")
        self.capture = frozenset(capture)
        self.layers = None if layers is None else set(layers)
        self.heads = heads
        self.history = AttentionHistory()
        # the hook points this tracer reads; every other point returns at once
        self._points = tuple(point for wanted, point in (
            ("cache" in self.capture, "attn.cache_read"), ("attention" in self.capture, "attn.probs"),
            ("qkv" in self.capture, "attn.q"), ("qkv" in self.capture, "attn.k_new"),
            ("qkv" in self.capture, "attn.v_new")) if wanted)
        self._cache: KVCache | None = None
        self._pos = self._q_len = 0
        self._step: StepTrace | None = None
        self._pending: list = []  # (device tensor, what to do with its host copy) until the step ends
        self._press: PressOutcome | None = None  # the press outcome recorded last (shared until the next press)

    # -- the protocol the model calls --------------------------------------------------------------------
    def wants_attention(self, layer: int) -> bool:
        return "attention" in self.capture and self._layer_wanted(layer)

    def hook(self, name: str, t: torch.Tensor) -> None:
        step = self._step
        if step is None or not name.endswith(self._points):
            return
        parts = name.split(".")
        if parts[0] != "layers" or not self._layer_wanted(int(parts[1])):
            return
        layer, point = int(parts[1]), ".".join(parts[2:])
        if point == "attn.cache_read" and "cache" in self.capture:
            step.events.append(self._event(layer, t))
        elif point == "attn.probs":
            rows = t[0] if self.heads is None else t[0, self.heads]  # (heads, T, S), first sequence
            first = self._pos + self._q_len - rows.shape[1]  # the query position of the first row
            self.later(rows.transpose(0, 1).float(),
                       lambda h: step.keep_attention(layer, self.history.append(h, first)))
        elif "qkv" in self.capture and point in ("attn.q", "attn.k_new", "attn.v_new"):
            self.later(t, lambda h: step.qkv.__setitem__(name, h))

    def later(self, t: torch.Tensor, land) -> None:
        """Bring ``t`` to the host after the forward pass, with everything else the step captured (one copy, one
        sync on CUDA), and call ``land(host_copy)`` then. ``t`` must not be changed in place before the step ends
        (the model's activations never are; a cache's storage is, so pass a clone of it)."""
        self._pending.append((t.detach(), land))

    def note_ranks(self, ranks: RankStep) -> None:
        """Keep what every rank did in this step's pass (a lane over several processes calls it after the pass)."""
        if self._step is not None:
            self._step.ranks = ranks

    # -- the protocol the generator calls ----------------------------------------------------------------
    def begin_step(self, cache: KVCache, pos: int, q_len: int) -> None:
        self._cache, self._pos, self._q_len = cache, pos, q_len
        self._step = StepTrace(_history=self.history)
        self._pending = []

    def end_step(self, cache: KVCache) -> StepTrace:
        """The step's trace: what the hooks captured lands on the host here, in one transfer after the pass."""
        step, self._step = self._step, None
        pending, self._pending = self._pending, []
        sparse = cache.inspect.pending_reads()
        landed = host.fetch([t for t, _ in pending] + list(sparse.values()))
        for (_, land), copy in zip(pending, landed):
            land(copy)
        cache.inspect.land_reads(dict(zip(sparse, landed[len(pending):])))
        c = cache.config
        computed = list(range(self._pos + self._q_len))  # what a cache that keeps nothing read
        by_kind: dict[tuple, list[int]] = {}
        for spec in cache.plan:  # one list per kind of read (full, sliding, each shared source, each sparse layer)
            key = cache.inspect.read_group(spec.index)
            if key not in by_kind:
                by_kind[key] = cache.inspect.read_positions(spec.index) or computed
            step.layer_reads.append(by_kind[key])
        step.main_layer = cache.full_layers[0] if cache.full_layers else 0
        step.heads = list(range(c.num_heads)) if self.heads is None else list(self.heads)
        step.gqa_groups = c.gqa_groups
        if "cache" in self.capture:
            step.layer_slots = cache.inspect.slot_views()
            step.press = press_record(cache, self._press)
            self._press = step.press.last if step.press is not None else None
        self._cache = None  # a tracer kept after the run must not keep the cache alive
        return step

    # -- internals ---------------------------------------------------------------------------------------
    def _layer_wanted(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def _event(self, layer: int, k_read: torch.Tensor) -> CacheEvent:
        cache = self._cache
        storages = {t.untyped_storage().data_ptr() for t in cache.inspect.storage(layer)}
        wrote = 0 if cache.plan[layer].shares else self._q_len
        return CacheEvent(layer=layer, write=(self._pos, wrote), read=cache.inspect.read_window(layer, k_read.shape[2]),
                          read_shape=tuple(k_read.shape), data_ptr=k_read.data_ptr(),
                          storage_offset=k_read.storage_offset(), stride=tuple(k_read.stride()),
                          view=k_read.untyped_storage().data_ptr() in storages)

    def __repr__(self) -> str:
        return (f"Tracer(capture={sorted(self.capture)}, layers={self.layers}, heads={self.heads}, "
                f"attention held {self.history.nbytes} B)")


def checked_tracer(tracer: Any) -> Any:
    """``tracer`` if it is None or speaks the protocol a generator calls (a :class:`Tracer` or a look-alike)."""
    if tracer is not None and not all(callable(getattr(tracer, m, None)) for m in
                                      ("begin_step", "end_step", "hook", "wants_attention")):
        raise SettingsError(f"tracer must be a kvexplore Tracer (or have its begin_step, end_step, hook and "
                            f"wants_attention methods), got {type(tracer).__name__}")
    return tracer
