"""Presses: score-based KV cache eviction (the name after NVIDIA's kvpress catalogue), used by the ``evict`` cache.

:data:`PRESSES` maps a name to a :class:`Press` class; :func:`register_press` adds one, :func:`make_press` builds
one by name with its options. A press scores (:mod:`.press`); the budget and the per-head policy choose
(:mod:`.budget`); the cache stores what is kept (:mod:`kvexplore.caches.evict`).
"""

from __future__ import annotations

from typing import Any

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

PRESSES: dict[str, type] = {}


def register_press(cls: type) -> type:
    """Make ``cls`` (a :class:`Press` subclass) known by ``cls.name``; returns ``cls``."""
    if not isinstance(cls, type) or not issubclass(cls, Press):
        raise SettingsError(f"a press must be a Press subclass, got {cls!r}")
    PRESSES[cls.name] = cls
    return cls


for _cls in (KNormPress, SnapKVPress, TOVAPress, H2OPress, StreamingPress, KeyDiffPress):
    register_press(_cls)


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
        raise SettingsError(f"press {press!r} does not take {sorted(options or {})}: {e}") from e


__all__ = ["Budget", "H2OPress", "HEADS", "KNormPress", "KeyDiffPress", "Observation", "PRESSES", "Press",
           "SCHEDULES", "SnapKVPress", "StreamingPress", "TOVAPress", "attention", "make_press", "per_kv_head",
           "register_press", "select"]
