"""The page pool a prefix cache serves from: its free pages a queue, its policy choosing the page a write takes
(evicting what it cached, which an offload tier may keep first), and per page the tokens, writer, last user and hits
the frames show."""

from __future__ import annotations

from collections.abc import Callable

from ..caches.layers.paged_layer import PagePool
from .index import Eviction, PrefixIndex


class BlockPool(PagePool):
    def __init__(self, layers: int, num_blocks: int, block_size: int, index: PrefixIndex) -> None:
        super().__init__(layers, num_blocks, block_size)
        self.free = list(range(num_blocks))  # a queue: the front is offered to the policy first
        self.index = index
        index.pool = self
        self.tokens: list[tuple[int, ...]] = [()] * num_blocks  # what each page holds (as last written)
        self.stored_by: list[int | None] = [None] * num_blocks  # the request that wrote it
        self.last_used: list[int | None] = [None] * num_blocks  # the last request that held it
        self.hits = [0] * num_blocks  # requests served from it since it was written
        self.spill: Callable[[Eviction], None] | None = None  # told of each eviction before the page is reused

    def take(self) -> int:
        before = len(self.index.evictions)
        page = self.index.victim(self.free)
        if self.spill is not None and len(self.index.evictions) > before:  # its bytes are still in the page
            self.spill(self.index.evictions[-1])
        self.free.remove(page)
        self.refcount[page], self.written[page] = 1, 0
        self.tokens[page], self.hits[page] = (), 0
        return page
