"""Errors kvexplore raises on purpose: each message names the problem, the value and the fix."""

from __future__ import annotations


class KVExploreError(Exception):
    """Base class of every error kvexplore raises for bad input."""


class LoadError(KVExploreError, ValueError):
    """A checkpoint, config or tokenizer could not be loaded (missing file, wrong shape, corrupt data)."""


class UnsupportedModelError(LoadError):
    """The checkpoint is of an architecture or option kvexplore does not implement."""


class CacheFullError(KVExploreError, RuntimeError):
    """A write would go past the cache's capacity; nothing was written."""

    def __init__(self, used: int, needed: int, capacity: int) -> None:
        self.used, self.needed, self.capacity = used, needed, capacity
        super().__init__(
            f"cache full: {used} of {capacity} slots used and this write needs {needed} more "
            f"({used + needed} > {capacity}); create the cache with a larger max_seq_len "
            f"(at least {used + needed}) or rewind"
        )
