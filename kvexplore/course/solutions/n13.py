"""Notebook 13 (prefix sharing across requests): where a prefix hit stops."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

BLOCK, SHARED = 16, 45


def _hit() -> int:
    from ...prefix.pool import PrefixPool

    pool = PrefixPool(tiny(), num_blocks=16, block_size=BLOCK)
    first = list(range(5, 5 + 60))
    second = first[:SHARED] + [200 + t for t in range(15)]
    pool.serve(first, response=[5])
    return pool.serve(second, response=[5]).hit_tokens


EXERCISES = [
    Exercise("13.1", "number", "Two prompts agree on their first 45 tokens and differ at token 45. With blocks of 16, "
                               "how many of the second prompt's tokens come from the cache?", unit="tokens"),
]
ANSWERS = {"13.1": _hit}
MISTAKES = {"13.1": [
    (lambda: SHARED, "only whole blocks are shared: a block's hash covers all 16 of its tokens."),
    (lambda: 48, "the block holding token 45 differs in its last tokens, so its hash differs: it is not shared."),
    (lambda: 0, "the blocks before the one holding the first difference are identical, and cached."),
]}
HINTS = {"13.1": "find the block holding the first token that differs; the blocks before it are the hit."}
