"""Prefix-cache frames built by hand (plain frozen dataclasses): three requests over an 8-block pool of 4-token
blocks under the hash policy, worked out on paper, and an engine's event stream of two batches. The prefix views'
tests draw them (tests/screen/test_prefix_views.py, tests/screen/test_browser_prefix.py)."""

from __future__ import annotations

from kvexplore.prefix.frames import (CACHED, EVICTED, FREE, HIT, WRITTEN, BlockView, MissView, PoolFrame, RequestView,
                                     TreeNode)

BS, N = 4, 8
WORDS = {i: f"w{i} " for i in range(100)}  # token i reads "w<i> "


def text(tokens) -> str:
    return "".join(WORDS[t] for t in tokens)


def block(slot, state, tokens=(), hash=None, parent=None, refcount=0, stored_by=None, last_used=None, node=None,
          checkpoint=False):
    return BlockView(slot, state, hash, parent, tuple(tokens), text(tokens), refcount, stored_by, last_used,
                     checkpoint, node)


def node(id, parent, start, tokens, slots, state, hits=0, reachable=True):
    return TreeNode(id, parent, start, tuple(tokens), text(tokens), tuple(slots), state, hits, reachable)


def pool(index, title, blocks, tree, queue, request=None, notes=()):
    by = {b.slot: b for b in blocks}
    full = tuple(by.get(s, block(s, FREE)) for s in range(N))
    return PoolFrame(index, title, "hash", BS, N, full, tuple(tree), tuple(queue), request, tuple(notes),
                     bytes_per_block=1024)


A = list(range(1, 11))              # request 1: ten prompt tokens (two full blocks and a partial one)
B = [1, 2, 3, 4, 5, 6, 20, 21, 22]  # request 2: one block shared, then diverges at token 6 (inside block 1)
C = list(range(40, 52))             # request 3: three full blocks of new tokens, in a pool short of free blocks


def frames() -> list[PoolFrame]:
    r1 = RequestView(1, "request 1", 10, 0, 10, 2, 0,
                     (MissView("first-seen", 0, 10, "no earlier request began with these tokens"),), tuple(A), (60, 61),
                     text(A))
    r2 = RequestView(2, "request 2", 9, 4, 5, 1, 1024,
                     (MissView("diverged", 4, 9, "diverged at token 6: 'w20 ' where request 1 had 'w7 '"),), tuple(B),
                     (62,), text(B))
    r3 = RequestView(3, "request 3", 12, 0, 12, 0, 0,
                     (MissView("first-seen", 0, 12, "no earlier request began with these tokens"),), tuple(C), (),
                     text(C))
    return [
        pool(0, "empty pool", [], [], range(N)),
        pool(1, "request 1", [block(0, WRITTEN, A[:4], "aa01", None, 1, 1, 1, "aa01"),
                              block(1, WRITTEN, A[4:8], "bb02", "aa01", 1, 1, 1, "bb02"),
                              block(2, WRITTEN, A[8:] + [60, 61], None, None, 1, 1, 1)],
             [node("aa01", None, 0, A[:4], [0], WRITTEN), node("bb02", "aa01", 4, A[4:8], [1], WRITTEN)],
             [3, 4, 5, 6, 7, 2], r1),
        pool(2, "request 2", [block(0, HIT, A[:4], "aa01", None, 1, 1, 2, "aa01"),
                              block(1, CACHED, A[4:8], "bb02", "aa01", 0, 1, 1, "bb02"),
                              block(3, WRITTEN, B[4:8], "cc03", "aa01", 1, 2, 2, "cc03"),
                              block(4, WRITTEN, B[8:] + [62], None, None, 1, 2, 2)],
             [node("aa01", None, 0, A[:4], [0], HIT, 1), node("bb02", "aa01", 4, A[4:8], [1], CACHED),
              node("cc03", "aa01", 4, B[4:8], [3], WRITTEN)],
             [5, 6, 7, 2, 4, 1], r2),
        pool(3, "request 3", [block(0, EVICTED, A[:4], None, None, 0, 1, 2),
                              block(1, CACHED, A[4:8], "bb02", "aa01", 0, 1, 1, "bb02"),
                              block(3, CACHED, B[4:8], "cc03", "aa01", 0, 2, 2, "cc03"),
                              block(5, WRITTEN, C[:4], "dd04", None, 1, 3, 3, "dd04"),
                              block(6, WRITTEN, C[4:8], "ee05", "dd04", 1, 3, 3, "ee05"),
                              block(7, WRITTEN, C[8:], "ff06", "ee05", 1, 3, 3, "ff06", checkpoint=True)],
             [node("aa01", None, 0, A[:4], [0], EVICTED, 1), node("bb02", "aa01", 4, A[4:8], [1], CACHED,
                                                                   reachable=False),
              node("cc03", "aa01", 4, B[4:8], [3], CACHED, reachable=False),
              node("dd04", None, 0, C[:4], [5], WRITTEN), node("ee05", "dd04", 4, C[4:8], [6], WRITTEN),
              node("ff06", "ee05", 8, C[8:], [7], WRITTEN)],
             [2, 4, 0, 1, 3], r3, ("evicted slot 0 (aa01, least recently used) to make room",)),
    ]


def synthetic(num_blocks: int, requests: int, block_size: int = 16, seed: int = 0) -> list[PoolFrame]:
    """A pool of ``num_blocks`` over ``requests`` requests, made up (not worked out: for sizes, not for values):
    each request shares a random number of blocks of one of a few system prompts, then writes new ones; every block
    ends cached, the oldest evicted when the pool is full."""
    import random

    rng = random.Random(seed)
    state: dict[int, BlockView] = {}
    tree: dict[str, TreeNode] = {}
    order: list[int] = []  # cached slots, least recently used first
    free = list(range(num_blocks))
    out = [PoolFrame(0, "empty pool", "hash", block_size, num_blocks,
                     tuple(BlockView(s, FREE) for s in range(num_blocks)), (), tuple(free))]
    made = 0
    for r in range(1, requests + 1):
        shared = [s for s in order if state[s].stored_by is not None and rng.random() < 0.3][:8]
        new = rng.randint(2, max(3, num_blocks // 8))
        evicted = []
        while len(free) < new and order:
            s = order.pop(0)
            evicted.append(s)
            tree.pop(state[s].hash, None)
            free.append(s)
        parent = state[shared[-1]].hash if shared else None
        taken = [free.pop(0) for _ in range(min(new, len(free)))]
        for s in shared:
            state[s] = BlockView(s, HIT, state[s].hash, state[s].parent, state[s].tokens, state[s].text, 1,
                                 state[s].stored_by, r, False, state[s].hash)
        for s in taken:
            made += 1
            toks = tuple(rng.randrange(1000) for _ in range(block_size))
            h = f"{made:08x}"
            state[s] = BlockView(s, WRITTEN, h, parent, toks, " ".join(f"tok{t}" for t in toks), 1, r, r, False, h)
            tree[h] = TreeNode(h, parent, 0, toks, state[s].text, (s,), WRITTEN)
            parent = h
        blocks = [state.get(s, BlockView(s, FREE)) for s in range(num_blocks)]
        for s in evicted:
            blocks[s] = BlockView(s, EVICTED, stored_by=state[s].stored_by)
        req = RequestView(r, f"request {r}", (len(shared) + len(taken)) * block_size, len(shared) * block_size,
                          len(taken) * block_size, 4, len(shared) * 1024,
                          (MissView("first-seen", len(shared) * block_size, (len(shared) + len(taken)) * block_size,
                                    "no earlier request began with these tokens"),))
        out.append(PoolFrame(r, f"request {r}", "hash", block_size, num_blocks, tuple(blocks), tuple(tree.values()),
                             tuple(free + order), req, tuple(f"evicted slot {s}" for s in evicted), 1024))
        for s in shared + taken:  # done: cached, most recently used
            b = state[s]
            state[s] = BlockView(s, CACHED, b.hash, b.parent, b.tokens, b.text, 0, b.stored_by, r, False, b.node)
            if s in order:
                order.remove(s)
            order.append(s)
    return out


def events() -> list[PoolFrame]:
    """An engine's event stream as frames: batch 1 stores two blocks (a chain), batch 2 stores one more and removes
    the first."""
    def ev(index, blocks, tree, notes):
        return PoolFrame(index, f"batch {index}", "events", BS, 3, tuple(blocks), tuple(tree), (), None, notes)

    held = "held"
    return [ev(0, [], [], ()),
            ev(1, [block(0, held, A[:4], "e1", None, 0, 1, 1, "e1"), block(1, held, A[4:8], "e2", "e1", 0, 1, 1, "e2")],
               [node("e1", None, 0, A[:4], [0], held), node("e2", "e1", 4, A[4:8], [1], held)],
               ("BlockStored: 2 blocks",)),
            ev(2, [block(0, EVICTED, A[:4], "e1", None, 0, 1, 1), block(1, held, A[4:8], "e2", "e1", 0, 1, 1, "e2"),
                   block(2, held, C[:4], "e3", None, 0, 2, 2, "e3")],
               [node("e2", "e1", 4, A[4:8], [1], held, reachable=False), node("e3", None, 0, C[:4], [2], held)],
               ("BlockStored: 1 block", "BlockRemoved: 1 block"))]
