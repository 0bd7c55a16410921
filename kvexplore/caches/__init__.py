"""KV cache strategies, all behind :class:`KVCache`; :func:`make_cache` builds one by name. The strategies
(``kvexplore.caches.strategies``) and the presses load on first use: ``from kvexplore.caches import SinkCache`` or
``make_cache("sink", ...)`` imports the sink cache's module and no other strategy's."""

from importlib import import_module

from .base import EVICTED, FILLED, FREE, SHARED, STALE, KVCache, SlotView
from .journal import UndoJournal
from .layer import FullLayer, LayerCache, Step, StoredLayer
from .protocol import ModelCache
from .registry import (LAYER_KINDS, PREFIXES, STRATEGIES, register_layer_kind, register_prefix, register_strategy,
                       unregister_layer_kind, unregister_strategy)
from .layout import (EmptyLayout, GrowingLayout, Layout, LinearLayout, Mark, PagedLayout, QuantizedLayout, RingLayout,
                     SharedLayout)
from .layers.sliding import SlidingLayers
from .factory import make_cache

#: the names that load their module on first use: name -> module
LAZY = {"ConcatCache": ".strategies.concat", "EvictCache": ".strategies.evict", "NoCache": ".strategies.none",
        "PagedCache": ".strategies.paged", "PagePoolFullError": ".strategies.paged",
        "PreallocatedCache": ".strategies.preallocated", "QuantizedCache": ".strategies.quantized",
        "SinkCache": ".strategies.sink", "PRESSES": ".presses", "Press": ".presses", "make_press": ".presses",
        "register_press": ".presses"}

__all__ = ["EmptyLayout", "GrowingLayout", "Layout", "LinearLayout", "Mark", "PagedLayout", "QuantizedLayout",
           "RingLayout", "SharedLayout", "SlidingLayers", "EVICTED", "FILLED", "FREE", "KVCache", "SHARED", "STALE",
           "STRATEGIES", "SlotView", "make_cache", "UndoJournal", "FullLayer", "LayerCache", "Step", "StoredLayer",
           "ModelCache", "LAYER_KINDS", "PREFIXES", "register_layer_kind", "register_prefix", "register_strategy",
           "unregister_layer_kind", "unregister_strategy", *LAZY]


def __getattr__(name: str):
    if name not in LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY))
