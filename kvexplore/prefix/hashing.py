"""vLLM's automatic prefix caching over a pool: blocks named by chain hashes, and one free queue of every page no
request holds, cached or not, taken from the front (an eviction even while uncached pages wait: docs/prefix.md)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import takewhile

from .index import Eviction, Node, PrefixIndex, short


class HashIndex(PrefixIndex):
    name = "hash"
    taking = ("the front of one free queue (least recently freed first), cached or not: a cached block there is "
              "evicted")

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.table: dict[bytes, int] = {}  # chain hash -> the page caching that block
        self.blocks: dict[int, tuple[bytes, bytes | None, tuple[int, ...], int]] = {}  # page -> (hash, parent,
        # tokens, the block's index in its prefix)

    def match(self, ids: Sequence[int], hashes: list[bytes]) -> list[int]:
        return list(takewhile(lambda page: page is not None, (self.table.get(h) for h in hashes)))

    def insert(self, ids: Sequence[int], pages: list[int], hashes: list[bytes]) -> list[int]:
        bs, new = self.block_size, []
        for i, (page, h) in enumerate(zip(pages, hashes)):
            if h in self.table or page in self.blocks:
                continue  # cached already (this request hit it, or an earlier one wrote the same block)
            self.table[h] = page
            self.blocks[page] = (h, hashes[i - 1] if i else None, tuple(ids[i * bs: (i + 1) * bs]), i)
            new.append(page)
        return new

    def victim(self, free: list[int]) -> int:
        page = free[0]
        if page in self.blocks:
            h, parent, tokens, i = self.blocks.pop(page)
            del self.table[h]
            self.evictions.append(Eviction(h, page, tokens, parent, i * self.block_size))
        return page

    def hash_of(self, page: int) -> bytes | None:
        return self.blocks.get(page, (None, None))[0]

    def parent_of(self, page: int) -> bytes | None:
        return self.blocks.get(page, (None, None))[1]

    def nodes(self) -> list[Node]:
        """One node per cached block, its parent the block before it; a block whose parent is not cached any more
        is unreachable (and so is every block under it)."""
        out, reach = [], {}
        for page, (h, parent, _, i) in sorted(self.blocks.items(), key=lambda kv: (kv[1][3], kv[0])):
            reach[h] = parent is None or reach.get(parent, False)
            out.append(Node(short(h), short(parent), i * self.block_size, (page,), reach[h]))
        return out
