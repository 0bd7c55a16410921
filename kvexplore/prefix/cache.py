"""The paged cache a prefix pool serves requests with: sliding-window layers are paged too (every position kept,
each query reading its window), so their blocks are shared across requests like a full layer's; a ring holds only
the last window of one sequence, which another request could not start from."""

from __future__ import annotations

from ..caches.memory import layer_bytes
from ..caches.paged import PagedCache


class PoolCache(PagedCache):
    keeps_windows_whole = True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # a page holds every paged layer's keys and values: the full layers' and the sliding ones'
        self.table.page_bytes = sum(layer_bytes(s, self.block_size, 1, self.dtype) for s in self.plan
                                    if s.full or s.ring)
