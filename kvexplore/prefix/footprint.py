"""The bytes a prefix pool holds, as its pages hold them and as vLLM's hybrid KV cache manager would: vLLM gives a
hybrid model's sliding-window layers their own blocks and frees each one once it leaves the window, keeping cached
only the ones :mod:`kvexplore.prefix.sliding` says; kvexplore's pages hold every layer (one block table for all),
so a freed share stays in its page, counted here as vLLM's memory would not hold it (docs/prefix.md)."""

from __future__ import annotations

from ..caches.memory import layer_bytes


def shares(cache) -> tuple[int, int]:
    """Bytes of one page held by the full-attention layers and by the sliding-window layers."""
    full = sliding = 0
    for s in cache.plan:
        if s.full:
            full += layer_bytes(s, cache.block_size, 1, cache.dtype)
        elif s.ring and cache.keeps_windows_whole:
            sliding += layer_bytes(s, cache.block_size, 1, cache.dtype)
    return full, sliding


def sliding_kept(pool) -> set[int] | None:
    """The pages whose sliding-window share vLLM would still hold: cached for the sliding layers, or in the window
    of a request still running; None when no sliding layer follows vLLM's rule (no such layers, or radix)."""
    rule = pool.sliding
    if not rule.need:
        return None
    cached = set().union(*rule.cached.values())
    kept = {p for p in range(pool.num_blocks) if pool.index.hash_of(p) in cached}
    widest = max(rule.need)
    for cache in pool.running:
        table, start = cache.table.tables[0], max(cache.length - widest, 0) // pool.block_size
        kept.update(table[start:])
    return kept


def memory(pool, kept: set[int] | None) -> dict[str, int]:
    """Bytes held now: ``pages`` (the pages a request holds or a block is cached in: the pool's own figure), ``vllm``
    (the same with the sliding layers' freed shares left out, ``kept``: :func:`sliding_kept`), and how many of those
    pages have their sliding share freed."""
    full, sliding = shares(pool.cache)
    p = pool.pool
    used = [page for page in range(pool.num_blocks) if p.refcount[page] or pool.index.cached(page)]
    freed = 0 if kept is None else sum(1 for page in used if page not in kept)
    return {"pages": len(used) * pool.page_bytes, "vllm": len(used) * (full + sliding) - freed * sliding,
            "sliding_freed_blocks": freed, "full_share": full, "sliding_share": sliding}
