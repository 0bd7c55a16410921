"""Notebook 13 (prefix sharing across requests): where a prefix hit stops, and the bytes a shared system prompt
saves."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

BLOCK, SHARED = 16, 45
REQUESTS, SYSTEM, QUESTION = 4, 70, 10  # 13.2: requests running together, system prompt and question tokens


def _hit() -> int:
    from ...prefix.pool import PrefixPool

    pool = PrefixPool(tiny(), num_blocks=16, block_size=BLOCK)
    first = list(range(5, 5 + 60))
    second = first[:SHARED] + [200 + t for t in range(15)]
    pool.serve(first, response=[5])
    return pool.serve(second, response=[5]).hit_tokens


def _pool():
    """The tiny model's pool after REQUESTS requests that keep their pages (still running), each a SYSTEM-token system
    prompt and a QUESTION-token question of its own (the questions differ from their first token)."""
    from ...prefix.pool import PrefixPool

    pool = PrefixPool(tiny(), num_blocks=32, block_size=BLOCK)
    system = list(range(5, 5 + SYSTEM))
    users = [pool.serve(system + [1000 + 100 * r + t for t in range(QUESTION)], response=[5], keep=True)
             for r in range(REQUESTS)]
    return pool, users


def _saved() -> int:
    """Bytes of pages the running requests would hold without sharing, less those the pool holds."""
    pool, users = _pool()
    alone = sum(len(u.blocks) for u in users)
    held = pool.num_blocks - len(pool.free_queue)
    return (alone - held) * pool.page_bytes


def _page() -> int:
    from ...caches.memory import kv_bytes
    return kv_bytes(tiny().config, BLOCK)


EXERCISES = [
    Exercise("13.1", "number", "Two prompts agree on their first 45 tokens and differ at token 45. With blocks of 16, "
                               "how many of the second prompt's tokens come from the cache?", unit="tokens"),
    Exercise("13.2", "number", "Four requests to the tiny model (float32) run together on a PrefixPool with blocks of "
                               "16 (keep=True): each is the same 70-token system prompt followed by a 10-token "
                               "question of its own (the questions differ from their first token). How many bytes of "
                               "pages does sharing save, against the four holding their own pages?", unit="bytes"),
]
ANSWERS = {"13.1": _hit, "13.2": _saved}
MISTAKES = {"13.1": [
    (lambda: SHARED, "only whole blocks are shared: a block's hash covers all 16 of its tokens."),
    (lambda: 48, "the block holding token 45 differs in its last tokens, so its hash differs: it is not shared."),
    (lambda: 0, "the blocks before the one holding the first difference are identical, and cached."),
], "13.2": [
    (lambda: REQUESTS * (SYSTEM // BLOCK) * _page(), "the pool still holds the shared pages once: sharing saves the "
                                                     "copies of the requests after the first."),
    (lambda: (REQUESTS - 1) * -(-SYSTEM // BLOCK) * _page(), "the block holding the system prompt's last tokens "
                                                             "also holds the question's first ones: its hash differs, "
                                                             "so that block is not shared."),
    (lambda: (REQUESTS - 1) * SYSTEM * _page() // BLOCK, "the pool shares whole pages, not positions: count the "
                                                         "blocks of 16 the system prompt fills."),
    (lambda: (REQUESTS - 1) * (SYSTEM // BLOCK) * _page() // 2, "the tiny model runs in float32 here: 4 bytes a "
                                                                 "value (pool.page_bytes)."),
    (lambda: (SYSTEM // BLOCK) * _page(), "that is what one later request reads from the pool (its bytes_shared): "
                                          "the question asks the saving over all four."),
]}
HINTS = {"13.1": "find the block holding the first token that differs; the blocks before it are the hit.",
         "13.2": "count the whole blocks the four prompts share, the copies of them the later requests do not hold, "
                 "and the bytes of a page (2 x layers x KV heads x 16 x head_dim x 4 bytes)."}
