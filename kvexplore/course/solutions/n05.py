"""Notebook 05 (paged caches and shared prefixes): the pages a fork and two writes hold; the page table's make_room
(copy-on-write and a page per block), checked through the doctor and a fork."""

from __future__ import annotations

import torch

from ..code_check import CodeExercise, ForkCheck, PageTableExercise, paged_cache
from ..exercise import Exercise, Moment
from ..tiny import tiny

BLOCK, PROMPT = 16, 40


def _pages() -> int:
    from ...caches.factory import make_cache

    model = tiny()
    cache = make_cache("paged", model, max_seq_len=64, block_size=BLOCK, num_blocks=16)
    with torch.no_grad():
        model(torch.tensor([list(range(5, 5 + PROMPT))]), cache, 0)
        twin = cache.fork()
        model(torch.tensor([[7]]), cache, PROMPT)
        model(torch.tensor([[8]]), twin, PROMPT)
    return cache.pool.num_blocks - cache.pool.free_blocks


EXERCISES = [
    Exercise("05.1", "number", "A paged cache (blocks of 16) holds a 40-token prompt; it is forked, and each of the "
                               "two sequences then writes one token. How many pages does the pool hold?", unit="pages"),
]
ANSWERS = {"05.1": _pages}
MISTAKES = {"05.1": [
    (lambda: 3, "both sequences write into the last page, which is shared and only half full: the first to write "
                "copies it (copy-on-write)."),
    (lambda: 6, "a fork shares every page of its parent: nothing is copied until one of them writes into a shared "
                "page."),
    (lambda: 5, "after the first sequence copied the shared last page, the second holds the old one alone: it "
                "writes in place."),
]}
HINTS = {"05.1": "count the pages of the prompt (blocks of 16), then follow the two writes: which page does each "
                 "land in, and is it shared when it does?"}


# 05.2 (code): the page table's make_room, through the doctor and through a fork (code_check.py)

PAGE = 4  # positions per page in 05.2: the tiny model's 8-token prompt fills two pages, a fork of 6 shares a half one


def _paged(model, cls):
    return paged_cache(cls)(model.config, max_seq_len=64, block_size=PAGE, num_blocks=40)


def _pages_per_block(model, cls) -> str:
    table_of = _paged(model, cls).table
    table: list[int] = []
    for pos, q_len in ((0, 6), (6, 3)):
        table_of.make_room(table, pos, q_len)
        blocks = -(-(pos + q_len) // PAGE)
        for i, page in enumerate(table):
            if page in table[:i]:
                return (f"Hint: page {page} serves blocks {table.index(page)} and {i} of one block table (a page taken "
                        f"twice): each block needs a page of its own, and the later block's writes overwrite the "
                        f"earlier one's keys.")
        if len(table) != blocks:
            return (f"Hint: after a write of positions {pos}..{pos + q_len - 1} in pages of {PAGE}, the block table "
                    f"holds {len(table)} page{'s' * (len(table) != 1)} for {blocks} blocks (an off-by-one in the block "
                    f"count): every block a write reaches needs a page, the last, partly filled one included, and no "
                    f"more.")
    return ""


def _fork_pages(model, cls) -> str:
    table_of = _paged(model, cls).table
    pool = table_of.pool
    mine = [table_of.take(), table_of.take()]  # positions 0..5: page 2 holds 4 and 5, two slots of four
    theirs = list(mine)  # a fork: the other sequence's table holds the same pages
    for page in mine:
        pool.refcount[page] += 1
    table_of.make_room(mine, 6, 1)
    shared = theirs[-1]
    if pool.refcount[shared] < 1 or shared in pool.free:
        return (f"Hint: page {shared} went back to the free list while the other sequence still holds it (a page "
                f"freed while shared): the next page taken can be that one, and its writes then overwrite the other "
                f"sequence's keys. Drop one reference (pool.release(page)): a page is free when no table holds it.")
    if mine[-1] == shared:
        return (f"Hint: after a fork both block tables hold page {shared}, partly filled (positions 4..5), and the "
                f"write of position 6 went into it in place while the other sequence still holds it: the other "
                f"sequence then reads a key it never wrote. Copy a shared page to a page of your own before writing "
                f"into it (copy-on-write).")
    if pool.refcount[shared] != 1:
        return (f"Hint: page {shared} was copied, but it still counts {pool.refcount[shared]} holders while only the "
                f"other sequence holds it: drop the copied page's reference (pool.release), or it is never freed.")
    return ""


EXERCISES.append(Exercise("05.2", "layer", "Write the page table's make_room(table, pos, q_len): before a write, copy "
                                           "the last page if another sequence shares it and the write continues it "
                                           "(copy-on-write), then take a page for every new block the write reaches."))
CODE = {"05.2": CodeExercise(
    base=PageTableExercise, task="that writes make_room(table, pos, q_len)", model=tiny, cache=_paged,
    prompt=[5, 17, 42, 9, 100, 33, 61, 7], steps=6, probes=(_pages_per_block, _fork_pages), audit=True,
    fork=ForkCheck(prompt=[5, 17, 42, 9, 100, 33], first=[7, 9, 11, 13], second=[8, 10, 12, 14]),
    fallback="Hint: follow one write: is the last page shared (pool.refcount) and partly filled (pos % block_size)? "
             "which blocks does the write reach, and does each have a page?")}


class Reference(PageTableExercise):
    """The solution, in two steps a wrong one below gets wrong one at a time."""

    def make_room(self, table, pos, q_len):
        bs = self.block_size
        if pos % bs and self.pool.refcount[table[-1]] > 1:  # continuing a page another sequence holds
            self.copy_last(table, pos % bs)
        self.add_blocks(table, self.blocks_for(pos + q_len))

    def blocks_for(self, positions):
        return -(-positions // self.block_size)  # ceil: the last block may be partly filled

    def copy_last(self, table, filled):
        old, new = table[-1], self.take()
        self.copy_page(old, new, filled)  # the filled slots, every layer
        self.pool.release(old)            # one holder fewer: the other sequence keeps it
        table[-1] = new

    def add_blocks(self, table, blocks):
        while len(table) < blocks:
            table.append(self.take())


class WritesIntoSharedPage(Reference):
    def copy_last(self, table, filled):
        pass  # "the page is already ours to write"


class FreesSharedPage(Reference):
    def copy_last(self, table, filled):
        old, new = table[-1], self.take()
        self.copy_page(old, new, filled)
        self.pool.refcount[old] = 0  # "the old page is not needed any more"
        self.pool.free.append(old)
        table[-1] = new


class OneBlockShort(Reference):
    def blocks_for(self, positions):
        return positions // self.block_size  # floor: a partly filled last block gets no page


class TakesOnePageForAll(Reference):
    def add_blocks(self, table, blocks):
        if blocks > len(table):
            page = self.take()
            table.extend([page] * (blocks - len(table)))


REFERENCE = {"05.2": Reference}
WRONG = {"05.2": [(WritesIntoSharedPage, "in place while the other sequence still holds it"),
                  (FreesSharedPage, "a page freed while shared"),
                  (OneBlockShort, "an off-by-one in the block count"),
                  (TakesOnePageForAll, "a page taken twice")]}


# 05.3, predict then see: the pages a fork still shares after both sequences write one token
def _forked_explorer():
    from ...explorer.widget import Explorer

    ex = Explorer("tiny", strategies=("paged",), max_seq_len=64, prompt="Call me Ishmael. Some years ago",
                  strategy_options={"paged": {"block_size": 8}})
    ex.prefill()
    ex.fork()
    return ex


def _shared(ex) -> int:
    """The pages of the paged lane's table that the fork holds too (a reference count above 1)."""
    cache = ex.lanes["paged"].cache
    return sum(cache.pool.refcount[p] > 1 for p in cache.block_tables[0])


EXERCISES.append(Exercise("05.3", "predict", "The explorer prefilled a prompt on a paged cache (pages of 8 slots) and "
                                             "forked it: both sequences share every page. After the next Step (each "
                                             "writes one token), how many pages do they still share?", unit="pages"))
MOMENTS = {"05.3": Moment(_forked_explorer, _shared, lambda ex: ex.lanes["paged"].cache.length // 8,
                          "the cache map: the slots marked shared")}
MISTAKES["05.3"] = [
    (lambda ex: _shared(ex) + 1, "a write into a page both sequences hold copies the page first (copy-on-write): "
                                 "the page the new position lands in is no longer shared."),
    (lambda ex: 0, "only the page being written is copied: the full pages before it are read by both sequences and "
                   "stay shared."),
]
HINTS["05.3"] = "find the page the next position lands in: which pages does a write leave as they are?"
