"""A :class:`~kvexplore.prefix.frames.PoolFrame` of a pool as it is now: each page's state, hash, tokens and counts,
the tree of cached prefixes, the free queue, and the request that just ran with its misses."""

from __future__ import annotations

from collections.abc import Sequence

from .frames import CACHED, EVICTED, FREE, HELD, HIT, WRITTEN, BlockView, MissView, PoolFrame, RequestView, TreeNode
from .footprint import memory
from .index import Eviction, short


def _state(page: int, pool, hit: set[int], held: set[int], evicted: set[int]) -> str:
    if page in hit:
        return HIT
    if page in held:
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


class FrameMaker:
    """Makes a pool's frames, sharing what did not change between them (a page whose view is unchanged is the same
    :class:`BlockView`; a block's text is decoded once): a frame costs memory for what its request changed."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self._views: dict[int, tuple[tuple, BlockView]] = {}
        self._texts: dict[tuple[int, ...], str] = {}
        self._nodes: dict[tuple, TreeNode] = {}

    def text(self, tokens: tuple[int, ...]) -> str:
        tok = self.pool.tokenizer
        if tok is None or not tokens:
            return ""
        if tokens not in self._texts:
            if len(self._texts) > 65536:
                self._texts.clear()
            self._texts[tokens] = tok.decode(list(tokens))
        return self._texts[tokens]

    def frame(self, result, evictions: Sequence[Eviction], index: int) -> PoolFrame:
        pool = self.pool
        p, idx = pool.pool, pool.index
        evicted = {e.page for e in evictions}
        hit, held = (set(), set()) if result is None else (set(result.hit_blocks), set(result.blocks))
        gone = {e.page: e.hash for e in evictions}
        nodes = idx.nodes()
        node_of = {page: n.id for n in nodes for page in n.pages}
        saved = pool.states.saved
        kept = pool.sliding_kept()  # None: no sliding layers under vLLM's rule
        blocks = []
        for page in range(pool.num_blocks):
            h = idx.hash_of(page)
            state = _state(page, pool, hit, held, evicted)
            tokens = p.tokens[page] if state != FREE else ()
            freed = kept is not None and state != FREE and page not in kept
            key = (state, h, idx.parent_of(page) if h is not None else None, tokens, p.refcount[page],
                   p.stored_by[page], p.last_used[page], h in saved, node_of.get(page), gone.get(page), freed)
            last = self._views.get(page)
            if last is None or last[0] != key:
                view = BlockView(page, state, short(h), short(key[2]), tokens, self.text(tokens), key[4], key[5],
                                 key[6], key[7], key[8], short(key[9]), freed)
                self._views[page] = last = (key, view)
            blocks.append(last[1])
        by_state = {b.slot: b.state for b in blocks}
        tree = []
        for n in nodes:
            states = {by_state[page] for page in n.pages}
            state = next((s for s in (HIT, WRITTEN, HELD) if s in states), CACHED)
            key = (n.id, n.parent, n.start, n.pages, state, p.hits[n.pages[0]], n.reachable)
            if key not in self._nodes:
                tokens = tuple(t for page in n.pages for t in p.tokens[page])
                self._nodes[key] = TreeNode(n.id, n.parent, n.start, tokens, self.text(tokens), n.pages, state,
                                            key[5], n.reachable)
            tree.append(self._nodes[key])
        live = set(tree)
        self._nodes = {k: v for k, v in self._nodes.items() if v in live}
        known = {short(idx.hash_of(page)): n.id for n in nodes for page in n.pages}
        for e in evictions:  # shown once, in the frame that dropped them
            known.setdefault(short(e.hash), f"x{short(e.hash)}")
        for e in evictions:
            tree.append(TreeNode(f"x{short(e.hash)}", known.get(short(e.parent)), e.start, e.tokens,
                                 self.text(e.tokens), (e.page,), EVICTED, 0))
        title = "the empty pool" if result is None else result.explain().splitlines()[0]
        notes = [f"evicted block {short(e.hash)} (positions {e.start}..{e.start + len(e.tokens) - 1}) from "
                 f"page {e.page}" for e in evictions]
        meta = {"taking": pool.taking, "state_bytes": pool.states.bytes, "memory": memory(pool, kept)}
        if pool.tiers is not None:
            notes += tier_notes(result.moves if result is not None else [])
            meta["tiers"] = pool.tier_counts()
        return PoolFrame(index, title, pool.policy, pool.block_size, pool.num_blocks, tuple(blocks), tuple(tree),
                         tuple(p.free), None if result is None else request_view(result), tuple(notes),
                         pool.page_bytes, meta)


def tier_notes(moves) -> list[str]:
    """A request's tier moves in words, the modelled time with each."""
    out = []
    for m in moves:
        if m.target is None:
            out.append(f"block {short(m.hash)} dropped from {m.source} (the tier was full)")
        else:
            out.append(f"block {short(m.hash)} copied {m.source} → {m.target}: {m.nbytes:,} B, "
                       f"{m.seconds * 1e6:.2f} µs modelled ({m.link})")
    return out
