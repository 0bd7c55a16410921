"""The vLLM-style cache: a pool of fixed-size pages per layer and a block table per sequence.

Pages are taken from a free list as a sequence grows and returned when it is rewound. A fork shares the pool
(the same tensors) and copies the block table; reference counts per page live in the shared :class:`PagePool`,
so a shared prefix is stored once. Writing into a page another sequence also holds copies it first
(copy-on-write): only the last, partly filled page of a shared prefix is ever copied.
"""

from __future__ import annotations

import math

import torch

from ..config.model_config import ModelConfig
from ..core.settings import positive_int
from ..errors import CacheFullError, SettingsError
from ..config.layer_plan import FULL, LayerSpec
from .memory import full_layer_bytes
from .base import FILLED, FREE, SHARED, STALE, KVCache, SlotView
from .layout import PagedLayout


class PagePoolFullError(CacheFullError):
    """The pool has too few free pages for a write; nothing was written. ``used``/``needed``/``capacity`` count
    pages (in use, wanted by this write, in the pool)."""

    def __init__(self, used: int, needed: int, capacity: int, free: int) -> None:
        self.used, self.needed, self.capacity, self.free = used, needed, capacity, free
        Exception.__init__(
            self, f"page pool full: {used} of {capacity} pages in use ({free} free) and this write needs {needed} "
                  f"new page{'s' * (needed != 1)}; create the cache with a larger num_blocks or max_seq_len, "
                  f"or rewind this sequence, or free a fork (truncate(0) or drop it)")


class PagePool:
    """What a cache and its forks share: per full layer ``k``/``v`` ``[num_blocks, kv_heads, block_size, head_dim]``,
    a reference count per page (how many block tables hold it) and the free list."""

    def __init__(self, plan: list[LayerSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        def pages(s: LayerSpec, width: int) -> torch.Tensor | None:
            if s.kind != FULL:
                return None
            return torch.zeros((num_blocks, s.kv_heads, block_size, width), dtype=dtype, device=device)

        self.k = [pages(s, s.head_dim) for s in plan]  # full layers only (None for the others)
        self.v = [pages(s, s.value_width) for s in plan]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self.written = [0] * num_blocks  # slots of each page written since it was taken (for the slot view)
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: page 0 is taken first, freed pages next

    def take(self) -> int:
        page = self.free.pop()
        self.refcount[page], self.written[page] = 1, 0
        return page

    def release(self, page: int) -> bool:
        """Drop one reference; True when the page went back to the free list."""
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self.free.append(page)
            return True
        return False


class PagedCache(KVCache):
    """Pages of ``block_size`` positions from a shared :class:`PagePool`; block table ``b`` maps logical block
    ``i`` (positions ``i*block_size ..``) of sequence ``b`` to a physical page.

    ``num_blocks`` defaults to ``ceil(max_seq_len / block_size) * batch_size``. ``max_seq_len``, when given, also
    caps the positions of one sequence. A write scatters into the pages; attention reads a gather of the pages
    in logical order (a copy made for attention, not counted as ``copied_bytes``, which counts copy-on-write).
    """

    kind = "paged"

    def __init__(self, config: ModelConfig, max_seq_len: int | None = None, batch_size: int = 1,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 block_size: int = 16, num_blocks: int | None = None) -> None:
        block_size = positive_int(block_size, "block_size")
        if max_seq_len is None and num_blocks is None:
            raise SettingsError("PagedCache needs max_seq_len or num_blocks to size its page pool; give one of them")
        if max_seq_len is not None:
            max_seq_len = positive_int(max_seq_len, "max_seq_len")
        if num_blocks is not None:
            num_blocks = positive_int(num_blocks, "num_blocks")
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        if num_blocks is None:
            num_blocks = math.ceil(max_seq_len / block_size) * batch_size
        if num_blocks < 1:
            raise SettingsError(f"num_blocks must be at least 1, got {num_blocks}")
        self.max_seq_len, self.block_size = max_seq_len, block_size
        self.pool = PagePool(self.plan, num_blocks, block_size, self.dtype, self.device)
        self._tables: list[list[int]] = [[] for _ in range(batch_size)]
        self._prepared: tuple[int, int] | None = None  # (pos, q_len) whose pages are allocated
        self._read_idx = self._write_page = self._write_slot = None
        self._pages_written: list[int] = []

    # -- pages ------------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def free_blocks(self) -> int:
        """Pages on the pool's free list (shared with every fork)."""
        return len(self.pool.free)

    @property
    def block_tables(self) -> list[list[int]]:
        """Physical page of each logical block, one list per sequence (copies)."""
        return [list(t) for t in self._tables]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across the full layers, keys and values: ``2 * layers * kv_heads * block_size * hd *
        elt`` summed over them."""
        return full_layer_bytes(self.config, self.block_size, 1, self.dtype)

    def _pages_needed(self, pos: int, q_len: int) -> tuple[int, int]:
        """(pages this write takes from the free list, pages it gives back first by dropping blocks past pos)."""
        keep, end_blocks = math.ceil(pos / self.block_size), math.ceil((pos + q_len) / self.block_size)
        needed = released = 0
        for table in self._tables:
            released += sum(1 for p in table[keep:] if self.pool.refcount[p] == 1)
            needed += end_blocks - keep
            if pos % self.block_size and self.pool.refcount[table[keep - 1]] > 1:
                needed += 1  # copy-on-write of the shared, partly filled page the write continues
        return needed, released

    @property
    def capacity(self) -> int:
        """Longest length every sequence can reach from here, given the free pages (and ``max_seq_len``). A
        shared partly filled last page costs one page (its copy) before the sequence can grow."""
        bs, free = self.block_size, self.free_blocks
        n = math.ceil(self.length / bs)
        cows = sum(1 for t in self._tables if self.length % bs and self.pool.refcount[t[-1]] > 1)
        reach = self.length if cows > free else max(self.length, (n + (free - cows) // self.batch_size) * bs)
        return reach if self.max_seq_len is None else min(reach, self.max_seq_len)

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        super().check_write(pos, q_len, batch_size)
        if self.max_seq_len is not None and pos + q_len > self.max_seq_len:
            raise CacheFullError(used=pos, needed=q_len, capacity=self.max_seq_len)
        needed, released = self._pages_needed(pos, q_len)
        if needed > self.free_blocks + released:
            raise PagePoolFullError(self.num_blocks - self.free_blocks, needed, self.num_blocks, self.free_blocks)

    def _drop_blocks(self, keep: int) -> None:
        for table in self._tables:
            for page in table[keep:]:
                if self.pool.release(page):
                    self._step.frees += 1
                    self._step.freed_bytes += self.page_bytes
            del table[keep:]

    def _take(self) -> int:
        self._step.allocations += 1
        self._step.allocated_bytes += self.page_bytes
        return self.pool.take()

    def _prepare(self, pos: int, q_len: int) -> None:
        """Before the first layer writes: drop blocks past ``pos``, copy a shared partial page, take new pages,
        and build the scatter/gather indices every layer uses."""
        self.check_write(pos, q_len, self.batch_size)
        bs, keep = self.block_size, math.ceil(pos / self.block_size)
        self._drop_blocks(keep)
        for table in self._tables:
            if pos % bs and self.pool.refcount[table[-1]] > 1:  # copy-on-write: the filled slots, every layer
                old, new = table[-1], self._take()
                for pool in (t for t in (*self.pool.k, *self.pool.v) if t is not None):
                    self._keep(pool, 0, new, 1)  # the free page as it was, for a rollback
                    pool[new, :, : pos % bs].copy_(pool[old, :, : pos % bs])
                self.pool.release(old)
                table[-1] = new
                self.pool.written[new] = pos % bs
                self._step.copied_bytes += full_layer_bytes(self.config, pos % bs, 1, self.dtype)
            table.extend(self._take() for _ in range(math.ceil((pos + q_len) / bs) - keep))
            for p in range(pos, pos + q_len):
                page = table[p // bs]
                self.pool.written[page] = max(self.pool.written[page], p % bs + 1)
        self._pages_written = sorted({t[p // bs] for t in self._tables for p in range(pos, pos + q_len)})
        dev = self.device
        self._read_idx = torch.tensor(self._tables, dtype=torch.long, device=dev)  # (B, blocks)
        p = torch.arange(pos, pos + q_len, device=dev)
        self._write_page = self._read_idx[:, p // bs]  # (B, T)
        self._write_slot = (p % bs).expand(self.batch_size, q_len)  # (B, T)
        self._prepared = (pos, q_len)

    # -- the interface ----------------------------------------------------------------------------------
    def _write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, nkv, q_len, _ = k.shape
        if self._prepared != (pos, q_len):
            self._prepare(pos, q_len)
        for page in self._pages_written:  # the pages written, as they were (for a rollback)
            for pool in (self.pool.k[layer], self.pool.v[layer]):
                self._keep(pool, 0, page, 1)
        out = []
        for pool, new in ((self.pool.k[layer], k), (self.pool.v[layer], v)):
            pool[self._write_page, :, self._write_slot] = new.transpose(1, 2)  # (B, T, nkv, hd) into the pages
            pages = pool[self._read_idx]  # (B, blocks, nkv, bs, hd): a gather, a copy
            out.append(pages.transpose(1, 2).reshape(B, nkv, -1, new.shape[-1]).narrow(2, 0, pos + q_len))
        self._step.written_bytes += k.nbytes + v.nbytes
        return out[0], out[1]

    def commit(self, end: int) -> None:
        self._prepared = None
        super().commit(end)

    def _snapshot(self) -> dict:
        pool = self.pool
        return {**super()._snapshot(), "_tables": self.block_tables, "_prepared": None,
                "pool": (list(pool.refcount), list(pool.written), list(pool.free))}

    def _restore(self, snapshot: dict) -> None:
        refcount, written, free = snapshot["pool"]
        self.pool.refcount[:], self.pool.written[:], self.pool.free[:] = refcount, written, free  # shared: in place
        super()._restore({k: v for k, v in snapshot.items() if k != "pool"})

    def truncate(self, n: int) -> None:
        """Rewind to ``n`` positions: block-table entries past them are dropped and pages no sequence holds any
        more go back to the free list (counted as this report's frees)."""
        super().truncate(n)
        self._prepared = None
        self._drop_blocks(math.ceil(n / self.block_size))

    def fork(self) -> "PagedCache":
        """A second cache on the same pool (the same tensors) with a copy of the block tables: every page is
        shared (its reference count goes up) until one of them writes into it."""
        self._check_forkable()
        twin = object.__new__(PagedCache)
        twin.__dict__.update(self.__dict__)
        twin._tables = self.block_tables
        twin._prepared = None
        twin.rings = None if self.rings is None else self.rings.clone()  # rings are per sequence: never shared
        twin.states = None if self.states is None else self.states.clone()
        twin._undo, twin._undo_data, twin._reads, twin._masks = None, [], {}, {}
        twin._scratch, twin._scratch_used = {}, {}
        for table in self._tables:
            for page in table:
                self.pool.refcount[page] += 1
        return twin

    def _clone_storage(self, twin: "PagedCache") -> None:
        """An independent copy: its own pool (copied tensors, reference counts, free list)."""
        pool = object.__new__(PagePool)
        pool.__dict__.update(self.pool.__dict__)
        pool.k = [None if t is None else t.clone() for t in self.pool.k]
        pool.v = [None if t is None else t.clone() for t in self.pool.v]
        held = {p for t in self._tables for p in t}  # this cache's pages; pages only other forks hold are free
        pool.refcount = [1 if p in held else 0 for p in range(self.num_blocks)]
        pool.written = list(self.pool.written)
        pool.free = [p for p in reversed(range(self.num_blocks)) if p not in held]
        twin.pool, twin._tables, twin._prepared = pool, self.block_tables, None

    def __del__(self) -> None:
        # a dropped fork gives its pages back to the pool it shares
        try:
            for table in self._tables:
                for page in table:
                    self.pool.release(page)
            self._tables = []
        except Exception:  # half-built object, or interpreter shutdown
            pass

    def _storage(self, layer: int) -> list[torch.Tensor]:
        return [self.pool.k[layer], self.pool.v[layer]]

    def _slot_view(self) -> SlotView:
        """Every slot of the pool, page by page. This sequence's pages: ``filled``/``shared`` (sharers = the
        page's reference count) below the length; past it ``stale`` where written before a rewind, else ``free``.
        Free pages: ``free``. Pages only other forks hold: ``filled`` with position -1 and their reference count
        as sharers."""
        bs, n = self.block_size, self.length
        states, positions, sharers = [], [], []
        owner = {p: i for t in self._tables for i, p in enumerate(t)}
        for page in range(self.num_blocks):
            rc = self.pool.refcount[page]
            for slot in range(bs):
                if page in owner and owner[page] * bs + slot < n:
                    states.append(SHARED if rc > 1 else FILLED)
                    positions.append(owner[page] * bs + slot)
                    sharers.append(rc)
                elif page in owner:  # past the length: written before a rewind, or not yet written
                    states.append(STALE if slot < self.pool.written[page] else FREE)
                    positions.append(-1)
                    sharers.append(0)
                    continue
                else:
                    states.append(FREE if rc == 0 else FILLED)
                    positions.append(-1)
                    sharers.append(rc)
        layout = PagedLayout(block_size=bs, block_table=list(self._tables[0]), block_tables=self.block_tables,
                             free_blocks=self.free_blocks)
        return SlotView(states, positions, sharers, layout)

    @property
    def full_reserved_bytes(self) -> int:
        """Bytes of the whole pool. Forks share it, so each reports the whole pool (do not sum over forks);
        :attr:`pool_bytes_in_use` is the part held by any of them."""
        return self.num_blocks * self.page_bytes

    @property
    def pool_bytes_in_use(self) -> int:
        """Bytes of the pages some sequence of the pool (this cache or a fork) holds."""
        return (self.num_blocks - self.free_blocks) * self.page_bytes
