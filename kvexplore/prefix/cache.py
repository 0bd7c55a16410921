"""The paged cache a prefix pool serves requests with: sliding-window layers are paged too (every position kept,
each query reading its window), so their blocks are shared across requests like a full layer's; a ring holds only
the last window of one sequence, which another request could not start from."""

from __future__ import annotations

from ..caches.strategies.paged import PagedCache


class PoolCache(PagedCache):
    keeps_windows_whole = True
