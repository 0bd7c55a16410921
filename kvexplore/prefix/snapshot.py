"""A :class:`~kvexplore.prefix.frames.PoolFrame` of a pool as it is now: each page's state, hash, tokens and counts,
the tree of cached prefixes, the free queue, and the request that just ran with its misses."""

from __future__ import annotations

from collections.abc import Sequence

from .frames import CACHED, EVICTED, FREE, HELD, HIT, WRITTEN, BlockView, MissView, PoolFrame, RequestView, TreeNode
from .index import Eviction, short


def _state(page: int, pool, result, evicted: set[int]) -> str:
    if result is not None and page in result.hit_blocks:
        return HIT
    if result is not None and page in result.blocks:
        return WRITTEN
    if pool.pool.refcount[page] > 0:
        return HELD
    if page in evicted and not pool.index.cached(page):
        return EVICTED
    return CACHED if pool.index.cached(page) else FREE


def request_view(result) -> RequestView:
    misses = tuple(MissView(m.kind, m.start, m.end, m.reason) for m in result.misses)
    return RequestView(result.index, result.label, len(result.prompt), result.hit_tokens, result.recomputed_tokens,
                       len(result.generated), result.bytes_shared, misses, tuple(result.prompt),
                       tuple(result.generated), result.text)


def frame_of(pool, result, evictions: Sequence[Eviction], index: int) -> PoolFrame:
    p, idx, tok = pool.pool, pool.index, pool.tokenizer
    decode = (lambda ids: tok.decode(list(ids))) if tok is not None else (lambda ids: "")
    evicted = {e.page for e in evictions}
    gone = {e.page: e.hash for e in evictions}
    nodes = idx.nodes()
    node_of = {page: n.id for n in nodes for page in n.pages}
    saved = pool.states.saved
    blocks = []
    for page in range(pool.num_blocks):
        h = idx.hash_of(page)
        state = _state(page, pool, result, evicted)
        tokens = p.tokens[page] if state != FREE else ()
        blocks.append(BlockView(page, state, short(h), short(idx.parent_of(page)), tokens, decode(tokens),
                                p.refcount[page], p.stored_by[page], p.last_used[page], h in saved,
                                node_of.get(page), short(gone.get(page))))
    by_state = {b.slot: b.state for b in blocks}
    tree = []
    for n in nodes:
        states = {by_state[page] for page in n.pages}
        state = next((s for s in (HIT, WRITTEN, HELD) if s in states), CACHED)
        tokens = tuple(t for page in n.pages for t in p.tokens[page])
        tree.append(TreeNode(n.id, n.parent, n.start, tokens, decode(tokens), n.pages, state, p.hits[n.pages[0]],
                             n.reachable))
    known = {short(idx.hash_of(page)): n.id for n in nodes for page in n.pages}
    for e in evictions:  # shown once, in the frame that dropped them
        known.setdefault(short(e.hash), f"x{short(e.hash)}")
    for e in evictions:
        tree.append(TreeNode(f"x{short(e.hash)}", known.get(short(e.parent)), e.start, e.tokens, decode(e.tokens),
                             (e.page,), EVICTED, 0, False))
    title = "the empty pool" if result is None else result.explain().splitlines()[0]
    notes = tuple(f"evicted block {short(e.hash)} (positions {e.start}..{e.start + len(e.tokens) - 1}) from page "
                  f"{e.page}" for e in evictions)
    return PoolFrame(index, title, pool.policy, pool.block_size, pool.num_blocks, tuple(blocks), tuple(tree),
                     tuple(p.free), None if result is None else request_view(result), notes, pool.page_bytes,
                     {"taking": idx.taking, "state_bytes": pool.states.bytes})
