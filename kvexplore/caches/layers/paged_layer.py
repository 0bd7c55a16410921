"""A full layer of the vLLM-style paged cache, and the page pool and block tables its layers share. Pages are taken from
a free list as a sequence grows and returned when it is rewound. A fork shares the pool (the same tensors) and copies
the block tables; reference counts per page live in the shared :class:`PagePool`, so a shared prefix is stored once.
Writing into a page another sequence also holds copies it first (copy-on-write): only the last, partly filled page of a
shared prefix is ever copied."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..layer import FullLayer, Step, shallow_copy
from ..layout import PagedLayout
from ..memory import StepCounters
from ..slots import FILLED, FREE, SHARED, STALE, SlotView
from ...core import host


class PagePool:
    """What a cache and its forks share: per full layer ``k``/``v`` ``[num_blocks, kv_heads, block_size, width]``
    (``None`` for the other layers), a reference count per page (how many block tables hold it) and the free list."""

    def __init__(self, layers: int, num_blocks: int, block_size: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * layers
        self.v: list[torch.Tensor | None] = [None] * layers
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self.written = [0] * num_blocks  # slots of each page written since it was taken (for the slot view)
        self.free = list(range(num_blocks - 1, -1, -1))  # a stack: page 0 is taken first, freed pages next

    def take(self) -> int:
        page = self.free.pop()
        self.refcount[page], self.written[page] = 1, 0
        return page

    def hold(self, page: int) -> None:
        """One more reference to ``page``, which may be on the free list (a page kept for reuse)."""
        if self.refcount[page] == 0:
            self.free.remove(page)
            self.written[page] = self.block_size
        self.refcount[page] += 1

    def release(self, page: int) -> bool:
        """Drop one reference; True when the page went back to the free list."""
        self.refcount[page] -= 1
        if freed := self.refcount[page] == 0:
            self.free.append(page)
        return freed

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.k, *self.v) if t is not None]

    @property
    def free_blocks(self) -> int:
        """Pages on the free list (shared with every fork)."""
        return len(self.free)


class PageTable:
    """One sequence group's block tables on a :class:`PagePool` (shared by every full layer of one cache; a fork
    has its own table on the same pool). Plans each step once: drops blocks past ``pos``, copies a shared partly
    filled page, takes new pages, builds the scatter/gather indices every layer uses."""

    def __init__(self, pool: PagePool, batch_size: int, page_bytes: int, device: torch.device) -> None:
        self.pool, self.batch_size, self.page_bytes, self.device = pool, batch_size, page_bytes, device
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.prepared: tuple[int, int] | None = None  # (pos, q_len) whose pages are allocated
        self.read_idx = self.write_page = self.write_slot = None
        self.pages_written: list[int] = []
        self._step: int | None = None  # the serial of the step planned (not the step: its journal is not ours to keep)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the pages some sequence of the shared pool holds (this cache or a fork: the same figure)."""
        return (self.pool.num_blocks - self.pool.free_blocks) * self.page_bytes

    def copies(self) -> list[list[int]]:
        return [list(t) for t in self.tables]

    def pages_needed(self, pos: int, q_len: int) -> tuple[int, int]:
        """(pages a write takes from the free list, pages it gives back first by dropping blocks past pos)."""
        bs = self.block_size
        keep, end_blocks = math.ceil(pos / bs), math.ceil((pos + q_len) / bs)
        needed = released = 0
        for table in self.tables:
            released += sum(1 for p in table[keep:] if self.pool.refcount[p] == 1)
            needed += end_blocks - keep
            if pos % bs and self.pool.refcount[table[keep - 1]] > 1:
                needed += 1  # copy-on-write of the shared, partly filled page the write continues
        return needed, released

    def drop_blocks(self, keep: int, counters: StepCounters) -> None:
        for table in self.tables:
            for page in table[keep:]:
                if self.pool.release(page):
                    counters.frees += 1
                    counters.freed_bytes += self.page_bytes
            del table[keep:]

    def _take(self, counters: StepCounters) -> int:
        counters.allocations += 1
        counters.allocated_bytes += self.page_bytes
        return self.pool.take()

    def plan(self, step: Step) -> None:
        pos, q_len = step.pos, step.q_len
        if self._step == step.serial and self.prepared == (pos, q_len):
            return
        pool, c = self.pool, step.counters
        if self._step != step.serial:
            step.journal.remember(self._restore, (self.copies(), list(pool.refcount), list(pool.written),
                                                  list(pool.free)))
        self._step = step.serial
        bs, keep = self.block_size, math.ceil(pos / self.block_size)
        self.drop_blocks(keep, c)
        for table in self.tables:
            if pos % bs and pool.refcount[table[-1]] > 1:  # copy-on-write: the filled slots, every layer
                old, new = table[-1], self._take(c)
                for t in pool.tensors():
                    step.journal.keep(t, 0, new, 1)  # the free page as it was, for a rollback
                    t[new, :, : pos % bs].copy_(t[old, :, : pos % bs])
                    c.copied_bytes += t[old, :, : pos % bs].nbytes
                pool.release(old)
                table[-1] = new
                pool.written[new] = pos % bs
            table.extend(self._take(c) for _ in range(math.ceil((pos + q_len) / bs) - keep))
            for p in range(pos, pos + q_len):
                page = table[p // bs]
                pool.written[page] = max(pool.written[page], p % bs + 1)
        self.pages_written = sorted({t[p // bs] for t in self.tables for p in range(pos, pos + q_len)})
        self.read_idx = host.upload(self.tables, self.device, torch.long)  # (B, blocks)
        p = torch.arange(pos, pos + q_len, device=self.device)
        self.write_page = self.read_idx[:, p // bs]  # (B, T)
        self.write_slot = (p % bs).expand(self.batch_size, q_len)  # (B, T)
        self.prepared = (pos, q_len)

    def _restore(self, saved: tuple) -> None:
        tables, refcount, written, free = saved
        self.tables = [list(t) for t in tables]
        self.pool.refcount[:], self.pool.written[:], self.pool.free[:] = refcount, written, free  # shared: in place
        self.prepared, self._step = None, None

    def commit(self) -> None:
        self.prepared, self._step = None, None

    def truncate(self, n: int, counters: StepCounters) -> None:
        self.prepared, self._step = None, None
        self.drop_blocks(math.ceil(n / self.block_size), counters)

    def release(self, tail_first: bool = False) -> None:
        """Give every page of these tables back to the pool (a dropped fork); ``tail_first``: each table's last page
        first (a pool that reuses free pages in the order they came back then takes a prefix's tail first)."""
        for table in self.tables:
            for page in (reversed(table) if tail_first else table):
                self.pool.release(page)
        self.tables = []

    def fork(self) -> "PageTable":
        """A second table on the same pool: every page is shared (its reference count goes up)."""
        twin = shallow_copy(self, PageTable)
        twin.tables, twin.prepared, twin._step = self.copies(), None, None
        for table in self.tables:
            for page in table:
                self.pool.refcount[page] += 1
        return twin

    def clone(self) -> "PageTable":
        """An independent copy: its own pool (copied tensors, reference counts, free list)."""
        old = self.pool
        pool = shallow_copy(old, PagePool)
        pool.k = [None if t is None else t.clone() for t in old.k]
        pool.v = [None if t is None else t.clone() for t in old.v]
        held = {p for t in self.tables for p in t}  # this cache's pages; pages only other forks hold are free
        pool.refcount = [1 if p in held else 0 for p in range(old.num_blocks)]
        pool.written = list(old.written)
        pool.free = [p for p in reversed(range(old.num_blocks)) if p not in held]
        twin = shallow_copy(self, PageTable)
        twin.pool, twin.tables, twin.prepared, twin._step = pool, self.copies(), None, None
        return twin

    def slot_view(self, length: int) -> SlotView:
        """Every slot of the pool, page by page. This sequence's pages: ``filled``/``shared`` (sharers = the page's
        reference count) below the length; past it ``stale`` where written before a rewind, else ``free``. Free pages:
        ``free``. Pages only other forks hold: ``filled`` with position -1 and their reference count as sharers."""
        bs, n, pool = self.block_size, length, self.pool
        slots = []  # (state, position, sharers) of every slot
        owner = {p: i for t in self.tables for i, p in enumerate(t)}
        for page in range(pool.num_blocks):
            rc = pool.refcount[page]
            for slot in range(bs):
                if page in owner and owner[page] * bs + slot < n:
                    slots.append((SHARED if rc > 1 else FILLED, owner[page] * bs + slot, rc))
                elif page in owner:  # past the length: written before a rewind, or not yet written
                    slots.append((STALE if slot < pool.written[page] else FREE, -1, 0))
                else:
                    slots.append((FREE if rc == 0 else FILLED, -1, rc))
        states, positions, sharers = map(list, zip(*slots))
        layout = PagedLayout(block_size=bs, block_table=list(self.tables[0]), block_tables=self.copies(),
                             free_blocks=len(pool.free))
        return SlotView(states, positions, sharers, layout)


class PagedLayer(FullLayer):
    """One full layer's pages: ``table.pool.k[index]``/``.v[index]``. A write scatters into the pages; attention
    reads a gather of the pages in logical order (a copy made for attention, not counted as copied bytes)."""

    _held_names = {"table": "page tables", "pool": "page pool"}

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, table: PageTable) -> None:
        super().__init__(spec, batch_size, dtype, device)
        self.table = table
        pool = table.pool
        pool.k[spec.index] = torch.zeros((pool.num_blocks, spec.kv_heads, pool.block_size, self._widths[0]),
                                         dtype=dtype, device=device)
        pool.v[spec.index] = torch.zeros((pool.num_blocks, spec.kv_heads, pool.block_size, self._widths[1]),
                                         dtype=dtype, device=device)

    def begin(self, step: Step) -> None:
        self.table.plan(step)

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, nkv, q_len, _ = k.shape
        table, i = self.table, self.spec.index
        table.plan(step)
        pool = table.pool
        for page in table.pages_written:  # the pages written, as they were (for a rollback)
            step.journal.keep(pool.k[i], 0, page, 1)
            step.journal.keep(pool.v[i], 0, page, 1)
        out = []
        for pages, new in ((pool.k[i], k), (pool.v[i], v)):
            pages[table.write_page, :, table.write_slot] = new.transpose(1, 2)  # (B, T, nkv, hd) into the pages
            read = pages[table.read_idx]  # (B, blocks, nkv, bs, hd): a gather, a copy
            out.append(read.transpose(1, 2).reshape(B, nkv, -1, new.shape[-1]).narrow(2, 0, step.end))
        step.counters.written_bytes += k.nbytes + v.nbytes
        return out[0], out[1]

    def commit(self, step: Step) -> None:
        self.table.commit()

    _crop_way = ("pages that hold only drafted positions go back to the pool; the kept pages, and a shared prefix's "
                "reference counts, are untouched")

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        self.table.truncate(n, counters)

    def storage(self) -> list[torch.Tensor]:
        return [self.table.pool.k[self.spec.index], self.table.pool.v[self.spec.index]]

    def _reserved_bytes(self) -> int:
        return sum(t.nbytes for t in self.storage())

    def _slot_view(self, length: int) -> SlotView:
        return self.table.slot_view(length)

    def _copy(self, memo: dict[int, Any], make) -> "PagedLayer":
        twin = shallow_copy(self, PagedLayer)
        if id(self.table) not in memo:
            memo[id(self.table)] = make(self.table)
        twin.table = memo[id(self.table)]
        return twin

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "PagedLayer":
        return self._copy(memo, PageTable.fork if fork else PageTable.clone)
