"""KV cache strategies, all behind :class:`KVCache`; :func:`make_cache` builds one by name."""

from .base import EVICTED, FILLED, FREE, SHARED, STALE, KVCache, SlotView
from .journal import UndoJournal
from .layer import FullLayer, LayerCache, Step, StoredLayer
from .protocol import ModelCache
from .registry import (LAYER_KINDS, PREFIXES, register_layer_kind, register_prefix, register_strategy,
                       unregister_layer_kind, unregister_strategy)
from .layout import (EmptyLayout, GrowingLayout, Layout, LinearLayout, Mark, PagedLayout, QuantizedLayout, RingLayout,
                     SharedLayout)
from .layers.sliding import SlidingLayers
from .concat import ConcatCache
from .factory import STRATEGIES, make_cache
from .none import NoCache
from .paged import PagedCache, PagePoolFullError
from .preallocated import PreallocatedCache
from .quantized import QuantizedCache
from .sink import SinkCache
from .evict import EvictCache
from .presses import PRESSES, Press, make_press, register_press

__all__ = ["EvictCache", "PRESSES", "Press", "make_press", "register_press", "EmptyLayout", "GrowingLayout", "Layout", "LinearLayout", "Mark", "PagedLayout", "QuantizedLayout",
           "RingLayout", "SharedLayout", "SlidingLayers", "ConcatCache", "EVICTED", "FILLED", "FREE", "KVCache", "NoCache", "PagedCache", "PagePoolFullError", "PreallocatedCache", "QuantizedCache", "SHARED", "SinkCache",
           "STALE", "STRATEGIES", "SlotView", "make_cache", "UndoJournal", "FullLayer", "LayerCache", "Step",
           "StoredLayer", "ModelCache", "LAYER_KINDS", "PREFIXES", "register_layer_kind", "register_prefix",
           "register_strategy", "unregister_layer_kind", "unregister_strategy"]
