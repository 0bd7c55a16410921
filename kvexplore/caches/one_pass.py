"""One forward pass's bookkeeping on a cache, written once: the only place a pass commits the cache's length. Every pass
over a :class:`~kvexplore.KVCache` goes through :func:`one_pass`, whoever computes it: the eager model (``model(ids,
cache, pos)``), the compiled one-token step, the explorer's reused pass. The code inside the block only writes keys and
values (``cache.write``); the length, the undo journal and the memory report are this function's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def one_pass(cache: Any, pos: int, q_len: int, batch: int = 1, model: Any = None,
             keep_undo: bool = False) -> Iterator[None]:
    """Run the block as one pass writing ``q_len`` positions at ``pos`` into ``cache``: the write is checked and the
    step begun first, a block that raises rolls the cache back exactly, and after it the cache holds ``pos + q_len``
    positions (``keep_undo``: what ``cache.rollback()`` needs is kept until ``cache.settle()``)."""
    cache.check_write(pos, q_len, batch)
    cache.begin_step(pos, q_len, model)
    try:
        yield
        cache.commit(pos + q_len)  # a pressing cache presses here, after every layer wrote
    except BaseException:
        cache.rollback()  # some layers wrote, or a press failed half-way: put the cache back exactly as it was
        raise
    if not keep_undo:
        cache.settle()
