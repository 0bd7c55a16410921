"""The page pool a prefix cache serves from: its free pages a queue, its policy choosing the page a write takes
(evicting what it cached), and per page the tokens, writer, last user and hits the frames show."""

from __future__ import annotations

from ..caches.layers.paged_layer import PagePool
from .index import PrefixIndex


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

    def take(self) -> int:
        page = self.index.victim(self.free)
        self.free.remove(page)
        self.refcount[page], self.written[page] = 1, 0
        self.tokens[page], self.hits[page] = (), 0
        return page
