"""Presses: score-based KV cache eviction (the name after NVIDIA's kvpress catalogue), used by the ``evict`` cache.

:data:`PRESSES` maps a name to a :class:`Press` class; :func:`register_press` adds one (:func:`unregister_press`
removes it), :func:`make_press` builds one by name with its options. A press scores (:mod:`.press`); the budget and
the per-head policy choose (:mod:`.budget`); the cache stores what is kept (:mod:`kvexplore.caches.strategies.evict`).
"""

from __future__ import annotations

from typing import Any

from ...core.registry import Registry
from ...errors import SettingsError
from .budget import HEADS, SCHEDULES, Budget, select
from .h2o import H2OPress
from .keydiff import KeyDiffPress
from .knorm import KNormPress
from .observation import Observation, attention, per_kv_head
from .press import Press
from .snapkv import SnapKVPress
from .streaming import StreamingPress
from .tova import TOVAPress
from ...core.settings import refused_options

PRESSES: Registry = Registry("press", "unregister_press")  # the built-in six, sealed below


def register_press(cls: type, replace: bool = False) -> type:
    """Make ``cls`` (a :class:`Press` subclass) known by ``cls.name``; returns ``cls``. A taken name is refused
    unless ``replace`` (never a built-in one)."""
    if not isinstance(cls, type) or not issubclass(cls, Press):
        raise SettingsError(f"a press must be a Press subclass, got {cls!r}")
    if not isinstance(getattr(cls, "name", None), str) or not cls.name:
        raise SettingsError(f"press {cls.__name__} needs a name: set name = '...' on the class")
    return PRESSES.add(cls.name, cls, replace)


def unregister_press(name: str) -> type:
    """Remove a press :func:`register_press` added; returns its class."""
    return PRESSES.remove(name)


for _cls in (KNormPress, SnapKVPress, TOVAPress, H2OPress, StreamingPress, KeyDiffPress):
    register_press(_cls)
PRESSES.seal()


def make_press(press: Any, options: dict[str, Any] | None = None) -> Press:
    """A press from its name (with ``options`` for its constructor) or a :class:`Press` object as it is."""
    if isinstance(press, Press):
        if options:
            raise SettingsError(f"press options {sorted(options)} were given with a press object; set them on "
                                f"the object instead")
        return press
    if not isinstance(press, str) or press not in PRESSES:
        raise SettingsError(f"unknown press {press!r}; available: {', '.join(PRESSES)} (or a Press object)")
    try:
        return PRESSES[press](**(options or {}))
    except TypeError as e:
        raise refused_options(PRESSES[press], options or {}, f"press {press!r}", e) from e


__all__ = ["Budget", "H2OPress", "HEADS", "KNormPress", "KeyDiffPress", "Observation", "PRESSES", "Press",
           "SCHEDULES", "SnapKVPress", "StreamingPress", "TOVAPress", "attention", "make_press", "per_kv_head",
           "register_press", "select", "unregister_press"]
