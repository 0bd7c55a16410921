"""StreamingLLM attention sinks: keep the first ``sinks`` positions and the last ``window`` positions, nothing else.
Position ``p >= sinks`` lives in slot ``sinks + (p - sinks) % window``; kept keys keep their original positions (never
re-rotated), so attention is the full model's restricted to the kept keys. The slots, the reads and which rewinds are
allowed: docs/strategies.md ("The sink cache")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ...errors import SettingsError
from ..base import KVCache
from ..inspector import Inspector
from ..options import Flag, Options, count, maybe, option, positive
from ..layers.sink_layer import SinkLayer, SinkSlots


@dataclass(frozen=True)
class SinkOptions(Options):
    window: int = option(help="the most recent positions kept (make_cache: the slots left after the sinks)",
                         check=positive, flag=Flag(int))
    sinks: int = option(4, help="positions kept from the start (default 4)", check=count, flag=Flag(int))
    max_seq_len: int | None = option(None, help="positions it accepts in all (default: unbounded)",
                                     check=maybe(positive, "unbounded"), flag=None)

    #: generate's window: with 4 sinks it evicts past 32 positions; the app's ring: 4 + 252 slots, so a pasted
    #: chapter evicts (the cache's own default ring holds the whole context)
    generate: ClassVar[Mapping[str, Any]] = {"window": 28}
    app: ClassVar[Mapping[str, Any]] = {"sinks": 4, "window": 252}

    @classmethod
    def fitted(cls, options: dict[str, Any], given: Mapping[str, Any], max_seq_len: int | None) -> dict[str, Any]:
        """The app's ring shrinks to caches of ``max_seq_len`` slots (unless its window was given): the sink lane
        starts evicting when a pre-allocated lane of that size fills, and goes on while that one sits out."""
        sinks = options.get("sinks", 0)
        if "window" in options and "window" not in given and max_seq_len and sinks + options["window"] > max_seq_len:
            options = {**options, "window": max(1, max_seq_len - sinks)}
        return options

    @classmethod
    def sizing(cls, slots: int, options: dict[str, Any]) -> int | None:
        """The ring gets the slots (``sinks + window`` of them) unless ``window`` is given."""
        sinks = options.get("sinks", 4)
        if "window" not in options:
            if isinstance(sinks, int) and not isinstance(sinks, bool) and slots <= sinks:
                raise SettingsError(f"max_seq_len={slots} leaves no window after sinks={sinks}: a sink cache holds "
                                    f"sinks + window slots; give max_seq_len > {sinks} or window= explicitly")
            options["window"] = slots - sinks if isinstance(sinks, int) else slots
        window = options["window"]
        return window + (sinks if isinstance(sinks, int) else 0) if isinstance(window, int) else None


class SinkCache(KVCache):
    """``sinks`` attention-sink positions plus a ring of the last ``window`` positions (see the module docs). The
    eviction bookkeeping is one :class:`~kvexplore.caches.layers.sink_layer.SinkSlots` shared by every full layer."""

    kind = "sink"
    Options = SinkOptions

    def __init__(self, config: ModelConfig, window: int, sinks: int = 4, batch_size: int = 1,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 max_seq_len: int | None = None) -> None:
        self.options = o = self.Options(window, sinks, max_seq_len)
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self.sinks, self.window, self._capacity = o.sinks, o.window, o.max_seq_len
        self.slots = SinkSlots(sinks, window, self.device)
        self._build()

    def full_layer(self, spec: LayerSpec) -> SinkLayer:
        return SinkLayer(spec, self.batch_size, self.dtype, self.device, self.slots)

    def _index(self) -> None:
        super()._index()
        if self.full_layers:  # a copy's layers share the copy of the bookkeeping
            self.slots = self.layers[self.full_layers[0]].slots

    @property
    def evicted_positions(self) -> range:
        """Every position evicted so far (always contiguous; ``.stop``: the first window position held)."""
        return range(self.sinks, self.slots.ws)

    @property
    def evicted_last_step(self) -> list[int]:
        """Positions the last forward pass evicted (empty after a rewind)."""
        return list(self.slots.evicted_last)

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        super().check_write(pos, q_len, batch_size)
        if pos < self.length and (msg := self.slots.rewind_error(pos)):
            raise SettingsError(f"write at position {pos} needs a rewind: {msg}")

    def key(self, layer: int) -> torch.Tensor | None:
        """The live key storage of ``layer``: ``sinks + window`` slots in storage order."""
        return self.layers[layer].k if layer in self.full_layers else None

    def value(self, layer: int) -> torch.Tensor | None:
        return self.layers[layer].v if layer in self.full_layers else None

    @property
    def inspect(self) -> "SinkInspector":
        return SinkInspector(self)


class SinkInspector(Inspector):
    """What a sink cache can say about itself: what it did to the sequence so far."""

    evicts_on_write = True  # the window drops its oldest position as each new one is written

    def what_it_did(self) -> str:
        cache = self.cache
        if not cache.evicted_positions:
            return (f"sink cache: nothing evicted yet: all {cache.length} positions fit in {cache.sinks} sinks + a "
                    f"window of {cache.window} (a smaller window evicts sooner)")
        return (f"sink cache: evicted {len(cache.evicted_positions)} positions, keeps the first {cache.sinks} and the "
                f"last {cache.window}")
