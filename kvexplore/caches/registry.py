"""The cache registries: strategies by name (:data:`STRATEGIES`), layer kinds (:data:`LAYER_KINDS`: a plan's
``LayerSpec.kind`` -> ``make(cache, spec, built, shared)``) and name prefixes other packages serve (:data:`PREFIXES`,
``"hf:"``). With :mod:`kvexplore.config.layer_plan` and :mod:`.factory` this is where a layer kind or a strategy name is
looked up; no other cache code compares them (docs/extending.md, "The registries")."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, Callable

from ..config.layer_plan import FULL, SHARED, SLIDING, STATE, LayerSpec
from ..core.registry import Registry
from ..errors import SettingsError
from .protocol import ModelCache
from .layers.recompute import RecomputeLayer
from .layers.ring import RingLayer
from .layers.shared import SharedLayer
from .layers.state import StateLayer
from .layers.sliding import SlidingLayers

if TYPE_CHECKING:
    from .base import KVCache
    from .layer import LayerCache

LayerFactory = Callable[["KVCache", LayerSpec, list, dict], "LayerCache"]

STRATEGIES: Registry = Registry("strategy", "unregister_strategy")
for _name, _cls in (("preallocated", "PreallocatedCache"), ("concat", "ConcatCache"), ("none", "NoCache"),
                    ("paged", "PagedCache"), ("quantized", "QuantizedCache"), ("sink", "SinkCache"),
                    ("evict", "EvictCache")):  # the built-in seven, each imported when first asked for
    STRATEGIES.add_lazy(_name, f"kvexplore.caches.strategies.{_name}:{_cls}")
STRATEGIES.seal()
LAYER_KINDS: Registry = Registry("layer kind", "unregister_layer_kind")  # sealed below (the built-in four)
PREFIXES: Registry = Registry("name prefix", "unregister_prefix")  # "hf:" is added by kvexplore.hf


def register_strategy(name: str, cls: type, replace: bool = False) -> type:
    """Make ``cls`` (a :class:`~kvexplore.caches.base.KVCache` subclass) the strategy ``name``; returns ``cls``.
    ``cls.Options.sizing`` says how ``max_seq_len`` sizes it (see :meth:`~kvexplore.caches.options.Options.sizing`).
    A taken name is refused unless ``replace`` (never a built-in one); :func:`unregister_strategy` removes one."""
    if not isinstance(name, str) or not name or ":" in name:
        raise SettingsError(f"a strategy name is a non-empty string without ':' (prefixes are for other packages), "
                            f"got {name!r}")
    if not isinstance(cls, type) or not issubclass(cls, ModelCache):
        raise SettingsError(f"strategy {name!r} must be a KVCache subclass, got {cls!r}")
    if getattr(cls, "kind", None) != name:
        raise SettingsError(f"strategy {name!r}: the class's kind is {getattr(cls, 'kind', None)!r}; set "
                            f"kind = {name!r} on {cls.__name__} (lanes and records are named by it)")
    return STRATEGIES.add(name, cls, replace)


def unregister_strategy(name: str) -> type:
    """Remove a strategy :func:`register_strategy` added; returns its class."""
    return STRATEGIES.remove(name)


def register_layer_kind(kind: str, make: LayerFactory, replace: bool = False) -> LayerFactory:
    """Layers whose plan says ``kind`` get ``make(cache, spec, built, shared)``; returns ``make``. A taken kind is
    refused unless ``replace`` (never a built-in one); :func:`unregister_layer_kind` removes one."""
    if not callable(make):
        raise SettingsError(f"layer kind {kind!r}: make must be a function (cache, spec, built, shared) -> LayerCache")
    return LAYER_KINDS.add(kind, make, replace)


def unregister_layer_kind(kind: str) -> LayerFactory:
    """Remove a layer kind :func:`register_layer_kind` added; returns its factory."""
    return LAYER_KINDS.remove(kind)


def register_prefix(prefix: str, make: Callable[[Any, str, int | None], Any], replace: bool = False) -> Callable:
    """Cache names starting with ``prefix`` are made by ``make(model, kind, max_seq_len)``; returns ``make``."""
    return PREFIXES.add(prefix, make, replace)


def unregister_prefix(prefix: str) -> Callable:
    """Remove a prefix :func:`register_prefix` added; returns its function."""
    return PREFIXES.remove(prefix)


#: prefixes served by a package of kvexplore's that loads on first use: prefix -> the module that registers it
BUILT_IN_PREFIXES = {"hf:": "kvexplore.hf"}


def prefix_factory(kind: Any) -> Callable | None:
    """The factory registered for ``kind``'s prefix, if any (a built-in one's package imported first)."""
    if isinstance(kind, str):
        for prefix, module in BUILT_IN_PREFIXES.items():
            if kind.startswith(prefix) and prefix not in PREFIXES:
                import_module(module)
        for prefix, make in PREFIXES.items():
            if kind.startswith(prefix):
                return make
    return None


def build_layers(cache: "KVCache") -> list["LayerCache"]:
    """One layer cache per entry of ``cache.plan``, from its kind's factory (a layer the strategy refuses raises)."""
    built, shared = [], {}
    for spec in cache.plan:
        make = LAYER_KINDS.get(spec.kind)
        if make is None:
            raise SettingsError(f"layer {spec.index} is of kind {spec.kind!r}, which no cache serves; known kinds: "
                                f"{', '.join(LAYER_KINDS)} (register one with register_layer_kind)")
        built.append(make(cache, spec, built, shared))
    return built


def _full(cache: "KVCache", spec: LayerSpec, built: list, shared: dict) -> "LayerCache":
    if why := cache.refuses(spec):
        raise SettingsError(why)
    return cache.full_layer(spec)


def _sliding(cache: "KVCache", spec: LayerSpec, built: list, shared: dict) -> "LayerCache":
    if not cache.stores:  # a cache that stores nothing recomputes the layer under its window mask
        return RecomputeLayer(spec, spec.window)
    if cache.keeps_windows_whole:  # the strategy's own storage, every position, each query reading its window
        layer = _full(cache, spec, built, shared)
        layer.window = spec.window
        return layer
    slots = shared.setdefault("rings", SlidingLayers(spec.window))  # one slot map for every sliding layer
    return RingLayer(spec, cache.batch_size, cache.dtype, cache.device, slots)


def _shared(cache: "KVCache", spec: LayerSpec, built: list, shared: dict) -> "LayerCache":
    return SharedLayer(spec, built[spec.source])


def _state(cache: "KVCache", spec: LayerSpec, built: list, shared: dict) -> "LayerCache":
    return StateLayer(spec, cache.config, cache.batch_size, cache.dtype, cache.device)


register_layer_kind(FULL, _full)
register_layer_kind(SLIDING, _sliding)
register_layer_kind(SHARED, _shared)
register_layer_kind(STATE, _state)
LAYER_KINDS.seal()
