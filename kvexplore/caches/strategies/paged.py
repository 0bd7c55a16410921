"""The vLLM-style cache: a pool of fixed-size pages per full layer and a block table per sequence.

The pool and the block tables are shared by every full layer of one cache (and the pool by its forks): see
:mod:`kvexplore.caches.layers.paged_layer` for :class:`PagePool`, :class:`PageTable` and the layer class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ...errors import CacheFullError, SettingsError
from ..base import KVCache
from ..options import Flag, Options, maybe, option, positive
from ..layers.paged_layer import PagedLayer, PagePool, PageTable
from ..memory import layer_bytes

__all__ = ["PagedCache", "PagePool", "PagePoolFullError"]


class PagePoolFullError(CacheFullError):
    """The pool has too few free pages for a write; nothing was written. ``used``/``needed``/``capacity`` count
    pages (in use, wanted by this write, in the pool)."""

    def __init__(self, used: int, needed: int, capacity: int, free: int) -> None:
        self.used, self.needed, self.capacity, self.free = used, needed, capacity, free
        Exception.__init__(
            self, f"page pool full: {used} of {capacity} pages in use ({free} free) and this write needs {needed} "
                  f"new page{'s' * (needed != 1)}; create the cache with a larger num_blocks or max_seq_len, "
                  f"or rewind this sequence, or free a fork (truncate(0) or drop it)")


@dataclass(frozen=True)
class PagedOptions(Options):
    max_seq_len: int | None = option(None, help="positions of one sequence (sizes the pool unless num_blocks is given)",
                                     check=maybe(positive), flag=None)
    block_size: int = option(16, help="positions per page (default 16)", check=positive, flag=Flag(int))
    num_blocks: int | None = option(None, help="pages in the pool (default: enough for max_seq_len per sequence)",
                                    check=maybe(positive), flag=Flag(int))
    pool: Any = option(None, help="a PagePool made elsewhere (its block size and pages win)", flag=None)

    #: pages of 8 slots, so a short prompt already fills several
    app: ClassVar[Mapping[str, Any]] = {"block_size": 8}

    def __post_init__(self) -> None:
        if self.pool is not None:  # a pool made elsewhere (one that chooses which free page to take): its size wins
            object.__setattr__(self, "block_size", self.pool.block_size)
            object.__setattr__(self, "num_blocks", self.pool.num_blocks)
        super().__post_init__()

    def validate(self) -> None:
        if self.max_seq_len is None and self.num_blocks is None:
            raise SettingsError("PagedCache needs max_seq_len or num_blocks to size its page pool; give one of them")


class PagedCache(KVCache):
    """Pages of ``block_size`` positions from a shared :class:`PagePool`; block table ``b`` maps logical block ``i``
    (positions ``i*block_size ..``) of sequence ``b`` to a physical page. ``num_blocks`` defaults to ``ceil(max_seq_len
    / block_size) * batch_size``. ``max_seq_len``, when given, also caps the positions of one sequence. A write scatters
    into the pages; attention reads a gather of the pages in logical order (a copy made for attention, not counted as
    ``copied_bytes``, which counts copy-on-write). A fork shares the pool and every page (reference counts) until one of
    them writes into it; its rings and states are copied."""

    kind = "paged"
    Options = PagedOptions

    def __init__(self, config: ModelConfig, max_seq_len: int | None = None, batch_size: int = 1,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 block_size: int = 16, num_blocks: int | None = None, pool: PagePool | None = None) -> None:
        self.options = o = self.Options(max_seq_len, block_size, num_blocks, pool)
        max_seq_len, block_size, num_blocks = o.max_seq_len, o.block_size, o.num_blocks
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        if num_blocks is None:
            num_blocks = math.ceil(max_seq_len / block_size) * batch_size
        self.max_seq_len, self.block_size = max_seq_len, block_size
        pool = pool or PagePool(len(self.plan), num_blocks, block_size)
        # a page holds the keys and values of every layer kept in pages: the full ones, and the sliding ones when
        # this cache keeps windows whole
        paged = sum(layer_bytes(s, block_size, 1, self.dtype) for s in self.plan
                    if s.full or (s.ring and self.keeps_windows_whole))
        self.table = PageTable(pool, batch_size, paged, self.device)
        self._build()

    def full_layer(self, spec: LayerSpec) -> PagedLayer:
        return PagedLayer(spec, self.batch_size, self.dtype, self.device, self.table)

    def _index(self) -> None:
        super()._index()
        # the table every paged layer shares (the full layers', and sliding ones' when kept whole)
        self.table = next((layer.table for layer in self.layers if isinstance(layer, PagedLayer)), self.table)

    @property
    def pool(self) -> PagePool:
        """The page pool (shared with every fork)."""
        return self.table.pool

    @property
    def block_tables(self) -> list[list[int]]:
        """Physical page of each logical block, one list per sequence (copies)."""
        return self.table.copies()

    @property
    def capacity(self) -> int:
        """Longest length every sequence can reach from here, given the free pages (and ``max_seq_len``). A
        shared partly filled last page costs one page (its copy) before the sequence can grow."""
        bs, free = self.block_size, self.pool.free_blocks
        n = math.ceil(self.length / bs)
        cows = sum(1 for t in self.table.tables if self.length % bs and self.pool.refcount[t[-1]] > 1)
        reach = self.length if cows > free else max(self.length, (n + (free - cows) // self.batch_size) * bs)
        return reach if self.max_seq_len is None else min(reach, self.max_seq_len)

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        super().check_write(pos, q_len, batch_size)
        if self.max_seq_len is not None and pos + q_len > self.max_seq_len:
            raise CacheFullError(used=pos, needed=q_len, capacity=self.max_seq_len)
        needed, released = self.table.pages_needed(pos, q_len)
        pool = self.pool
        if needed > pool.free_blocks + released:
            raise PagePoolFullError(pool.num_blocks - pool.free_blocks, needed, pool.num_blocks, pool.free_blocks)

    def begin_step(self, pos: int = 0, q_len: int = 0, model=None) -> None:
        self.check_write(pos, q_len, self.batch_size)  # the plan takes pages: refuse before it does
        super().begin_step(pos, q_len, model)

    def sibling(self) -> "PagedCache":
        """An empty cache for another sequence on the same pool (the same tensors): what a server makes for each
        request. Its pages are its own, or adopted (:meth:`adopt`) from what the pool already holds."""
        twin = self._copy(True)
        twin.table.release()
        twin.table.tables = [[] for _ in range(self.batch_size)]
        twin._length, twin.book.report = 0, None
        return twin

    def adopt(self, pages: list[int], length: int) -> None:
        """Start this cache's (empty, one-sequence) table on ``pages`` of its pool that already hold positions
        ``0 .. length - 1`` (a prefix another sequence computed): each page's reference count goes up, nothing is
        written or copied. The next write continues at ``length``."""
        if self.batch_size != 1 or self.length or any(self.table.tables):
            raise SettingsError("adopt() starts an empty one-sequence paged cache on pages of its pool; this one "
                                "already holds positions (truncate(0) first) or has several sequences")
        if len(pages) != math.ceil(length / self.block_size):
            raise SettingsError(f"adopt(): {length} positions fill {math.ceil(length / self.block_size)} pages of "
                                f"{self.block_size}, {len(pages)} were given")
        for page in pages:
            self.pool.hold(page)
        self.table.tables[0] = list(pages)
        self._length, self.book.report = length, None

    def __del__(self) -> None:
        # a dropped fork gives its pages back to the pool it shares
        try:
            self.table.release()
        except Exception:  # half-built object, or interpreter shutdown
            pass
