"""Score-based eviction: a press scores each KV head's positions and the cache keeps the best within a budget.
``make_cache("evict", model, max_seq_len=..., press="knorm", compression_ratio=0.5, ...)``. The full-attention layers
are pressed; sliding layers keep their rings, recurrent layers their state (a latent layer is refused). When it presses
and the budget: :mod:`.layers.pressplan` and :mod:`.presses.budget`; the two storages (``"compact"``: memory freed,
``"mask"``: evicted positions masked in place), the two position modes (``"keep"``, ``"rerotate"``) and which rewinds
are refused: docs/eviction.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ...core.settings import integer
from ...errors import SettingsError
from ..base import KVCache
from ..inspector import Inspector
from ..options import Flag, Options, maybe, one_of, option, positive
from ..layers.compact import CompactLayer
from ..layers.masked import MaskedLayer
from ..layers.pressed import PressedLayer
from ..layers.pressplan import PressEvent, PressPlan
from ..presses import PRESSES, Budget, make_press
from ..presses.budget import HEADS, SCHEDULES

STORAGES = ("compact", "mask")
POSITION_MODES = ("keep", "rerotate")


def _at_least_one(hint: str) -> Any:
    return maybe(lambda value, name: integer(value, name, minimum=1, hint=hint))


@dataclass(frozen=True)
class EvictOptions(Options):
    """The press and its budget (checked by :class:`~kvexplore.caches.presses.Press` and
    :class:`~kvexplore.caches.presses.budget.Budget` as they are made), the storage and the presses while decoding."""

    press: Any = option("knorm", help="the press that scores positions (default knorm), or a Press",
                        flag=Flag(str, tuple(PRESSES)))
    compression_ratio: float | None = option(0.5, help="the share of each head's positions dropped (default 0.5)",
                                             flag=Flag(float))
    kept_tokens: int | None = option(None, help="positions each head keeps (instead of compression_ratio)",
                                     flag=Flag(int))
    schedule: str = option("uniform", help="the budget by layer: the same everywhere (default) or a pyramid",
                           flag=Flag(str, SCHEDULES))
    heads: str = option("per-head", help="the budget by head: per head (default), shared, adaptive (AdaKV)",
                        flag=Flag(str, HEADS))
    positions: str = option("keep", help="kept keys keep their positions (default) or are re-rotated to contiguous "
                                         "ones", check=one_of(POSITION_MODES, "positions"),
                            flag=Flag(str, POSITION_MODES))
    storage: str = option("compact", help="kept positions packed, memory freed (default), or masked in place",
                          check=one_of(STORAGES, "storage"), flag=Flag(str, STORAGES))
    decode_every: int | None = option(None, help="tokens between presses while decoding (default: the prompt only)",
                                      check=_at_least_one(" (tokens between presses while decoding)"), flag=Flag(int))
    decode_target: int | None = option(None, help="positions per head after a decoding press",
                                       check=_at_least_one(" (positions per head after a decoding press)"),
                                       flag=Flag(int))
    press_options: dict | None = option(None, help="the press's own options", flag=None)
    alpha: float = option(0.2, help="AdaKV's safeguard share (default 0.2)", flag=Flag(float))
    beta: float = option(20.0, help="PyramidKV's top-to-mean ratio (default 20)", flag=Flag(float))
    headroom: int | None = option(None, help="free slots a compacting layer keeps after a press (default "
                                             "decode_every, else 64)", check=maybe(positive), flag=Flag(int))
    max_seq_len: int | None = option(None, help="positions it accepts (storage mask: allocated once)",
                                     check=maybe(positive), flag=None)

    def validate(self) -> None:
        if self.decode_target is not None and self.decode_every is None:
            raise SettingsError("decode_target is the size a press during decoding goes down to; give "
                                "decode_every=N as well (how many tokens between those presses)")
        if self.decode_every is not None and self.decode_target is None and self.kept_tokens is None and \
                not self.compression_ratio:
            raise SettingsError("a press during decoding needs a target: give decode_target=N (positions per head), "
                                "or a prompt budget (compression_ratio > 0 or kept_tokens) it defaults to")
        if self.storage == "mask" and self.max_seq_len is None:
            raise SettingsError("storage='mask' allocates every position once: give max_seq_len")
        # the budget and the press check their own options, once, here
        object.__setattr__(self, "budget", Budget(self.compression_ratio, self.kept_tokens, self.schedule,
                                                  self.heads, self.alpha, self.beta))
        object.__setattr__(self, "made_press", make_press(self.press, self.press_options))


class EvictCache(KVCache):
    """See the module docstring and :class:`EvictOptions`. ``press``: a name
    (:data:`~kvexplore.caches.presses.PRESSES`) or a :class:`~kvexplore.caches.presses.Press`; during decoding it
    presses every ``decode_every`` tokens, down to ``decode_target`` positions per head."""

    kind = "evict"
    Options = EvictOptions

    @property
    def inspect(self) -> "EvictInspector":
        return EvictInspector(self)

    def __init__(self, config: ModelConfig, press: Any = "knorm", compression_ratio: float | None = 0.5,
                 kept_tokens: int | None = None, schedule: str = "uniform", heads: str = "per-head",
                 positions: str = "keep", storage: str = "compact", decode_every: int | None = None,
                 decode_target: int | None = None, press_options: dict | None = None, alpha: float = 0.2,
                 beta: float = 20.0, headroom: int | None = None, batch_size: int = 1,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 max_seq_len: int | None = None) -> None:
        self.options = o = self.Options(press, compression_ratio, kept_tokens, schedule, heads, positions, storage,
                                        decode_every, decode_target, press_options, alpha, beta, headroom,
                                        max_seq_len)
        self.budget, self.press = o.budget, o.made_press
        self.storage_kind, self.position_mode = o.storage, o.positions
        self.headroom = o.headroom if o.headroom is not None else o.decode_every or 64
        max_seq_len, decode_every, decode_target = o.max_seq_len, o.decode_every, o.decode_target
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._capacity = max_seq_len
        full = [s.index for s in self.plan if s.full]
        self.pressplan = PressPlan(self.press, self.budget, positions == "rerotate", decode_every, decode_target, full)
        self._build()

    def refuses(self, spec: LayerSpec) -> str | None:
        if spec.latent:
            return (f"layer {spec.index} stores one compressed latent for every head (MLA); the evict cache scores "
                    f"and keeps positions per KV head; use another cache kind for this model")
        return None

    def full_layer(self, spec: LayerSpec) -> PressedLayer:
        if self.storage_kind == "mask":
            return MaskedLayer(spec, self.batch_size, self.dtype, self.device, self.pressplan, self.config,
                               self._capacity)
        return CompactLayer(spec, self.batch_size, self.dtype, self.device, self.pressplan, self.config,
                            self.headroom)

    def _index(self) -> None:
        super()._index()
        self._pressed = frozenset(self.full_layers)  # asked by every attention layer at every step
        if self.full_layers:  # a copy's layers share the copy of the plan
            self.pressplan = self.layers[self.full_layers[0]].plan

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        super().check_write(pos, q_len, batch_size)
        if pos < self.length and self.full_layers:
            if msg := self.layers[self.full_layers[0]].take_back(pos, self.length).truncate:
                raise SettingsError(f"write at position {pos} needs a rewind: {msg}")

    def check_truncate(self, n: int, rings: bool = True) -> None:
        if rings and 0 < n < self.length and not self.pressplan.replayable(n) and (msg := self.inspect.replay_error(n)):
            raise SettingsError(f"cannot truncate to {n}: {msg} (recomputing the kept tokens instead would press them "
                                f"as one prompt, not as the presses ran)")
        super().check_truncate(n, rings)

    def truncate(self, n: int) -> None:
        super().truncate(n)
        if n == 0:  # a new sequence: the presses start over
            self.pressplan.restart()
            for i in self.full_layers:
                self.layers[i].restart()

    def _attach(self, model: Any) -> None:
        plan = self.pressplan
        plan.rotary = model.rotary
        if model.config.attention_sinks and plan.queries:  # the attention a press reads is the model's, sinks too
            layers = model.model.layers
            plan.sinks = {i: layers[i].self_attn for i in self.full_layers}  # the model's: not the cache's memory

    def _note_queries(self, layer: int, q: torch.Tensor) -> None:
        if self.pressplan.queries > 0 and layer in self._pressed:  # a press that reads queries, of a pressed layer
            self.layers[layer].note_queries(q)

    @property
    def eviction(self) -> "Eviction":
        return Eviction(self)


class Eviction:
    """The evict cache's answers to :class:`~kvexplore.caches.protocol.Eviction` (``cache.eviction``): per KV head,
    what each pressed layer holds, where each held key is rotated, what each head read; the presses so far."""

    def __init__(self, cache: EvictCache) -> None:
        self.cache = cache

    @property
    def press(self) -> Any:
        """The press (:class:`~kvexplore.caches.presses.Press`) that scores positions."""
        return self.cache.press

    @property
    def pressplan(self) -> PressPlan:
        """When and how far it presses (``pressplan.decode_every``: presses while decoding)."""
        return self.cache.pressplan

    def reads_queries(self, layer: int) -> bool:
        cache = self.cache
        return cache.pressplan.queries > 0 and layer in cache._pressed

    def _layer(self, layer: int) -> PressedLayer:
        cache = self.cache
        if layer not in cache._pressed:
            raise SettingsError(f"layer {layer} is not pressed (a {cache.plan[layer].kind} layer); pressed layers: "
                                f"{sorted(cache._pressed)}")
        return cache.layers[layer]

    def kept_positions(self, layer: int, batch: int = 0) -> list[list[int]]:
        """For each KV head of ``layer``, the sorted positions it still holds (of sequence ``batch``)."""
        return self._layer(layer).kept(self._batch(batch))

    def rope_positions(self, layer: int, batch: int = 0) -> list[list[int]]:
        """For each KV head, the position each held key is rotated at (in :meth:`kept_positions`'s order): the
        position itself unless re-rotated."""
        return self._layer(layer).rope_positions(self._batch(batch))

    def read_positions_by_head(self, layer: int, batch: int = 0) -> list[list[int]]:
        """For each KV head, the position in each key column ``layer``'s attention read in the last step (-1: a
        column that head did not hold): the compacting storage's columns are each head's own slots, the masking
        storage's the positions, every head alike."""
        return self._layer(layer).read_positions_by_head(self.cache.length, self._batch(batch))

    def kept_mask(self, layer: int, batch: int = 0) -> torch.Tensor:
        """``(kv_heads, length)`` bool on the host: which positions each head holds."""
        out = torch.zeros((self.cache.plan[layer].kv_heads, self.cache.length), dtype=torch.bool)
        for h, positions in enumerate(self.kept_positions(layer, batch)):
            out[h, positions] = True
        return out

    def press_scores(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The last press's scores ``(kv_heads, length then)`` by position (NaN where nothing was held) and what it
        kept, on the host, for the first sequence; None before any press."""
        target = self._layer(layer)
        return None if target.scores is None else (target.scores, target.scored_kept)

    @property
    def press_events(self) -> list[PressEvent]:
        return list(self.cache.pressplan.events)

    def overhead_slots(self, layer: int) -> int:
        """Slots of ``layer``'s storage holding no kept position (the compacting layer's headroom and padding; the
        masked layer's evicted and free positions)."""
        return self._layer(layer).overhead_slots()

    def held_counts(self, layer: int, batch: int = 0) -> tuple[int, ...]:
        """How many positions each KV head of ``layer`` holds (one small read, no position lists)."""
        return tuple(self._layer(layer).head_counts()[self._batch(batch)].tolist())

    def _batch(self, batch: int) -> int:
        return integer(batch, "batch", 0, self.cache.batch_size - 1)


class EvictInspector(Inspector):
    """What an evict cache can say about itself: what it did to the sequence so far, and when going back recomputes
    (only to where the presses could run again as they ran)."""

    def needs_replay(self, n: int) -> bool:
        return (n == 0 or self.cache.pressplan.replayable(n)) and super().needs_replay(n)

    def what_it_did(self) -> str:
        cache = self.cache
        events = cache.pressplan.events
        if not events:
            return (f"evict cache ({cache.press.name}): nothing pressed yet ({cache.length} positions held; the prompt "
                    f"is pressed when it is prefilled, and decoding presses only with decode_every=N)")
        last = events[-1]
        kept = f"{min(last.kept)}" if min(last.kept) == max(last.kept) else f"{min(last.kept)}-{max(last.kept)}"
        return (f"evict cache ({cache.press.name}): {len(events)} press{'es' if len(events) > 1 else ''}, the last "
                f"({last.reason}) at {last.length} positions kept {kept} per head in {len(last.kept)} pressed "
                f"layer{'s' if len(last.kept) > 1 else ''}")

    def speculation_refusal(self) -> str | None:
        cache = self.cache
        every = cache.pressplan.decode_every
        if every is None:
            return None
        return (f"presses while decoding (decode_every={every}) run at step boundaries, and a drafting generator's "
                f"steps are verification passes of several tokens: its tokens would not be plain decoding's. Press "
                f"after the prompt only (decode_every=None), or generate without draft=")
