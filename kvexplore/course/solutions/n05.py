"""Notebook 05 (paged caches and shared prefixes): the pages a fork and two writes hold."""

from __future__ import annotations

import torch

from ..exercise import Exercise

BLOCK, PROMPT = 16, 40


def _pages() -> int:
    from ...caches.factory import make_cache
    from ...formats.loading import load

    model = load("tiny")
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
