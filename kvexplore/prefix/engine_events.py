"""A pool's history as vLLM tells its own: one KV event batch per request, ``BlockRemoved`` for the blocks it evicted
and ``BlockStored`` for those it cached (a prefix's consecutive blocks in one event), in vLLM's map form."""

from __future__ import annotations

import time
from collections.abc import Sequence

from .index import Eviction, PrefixIndex

MEDIUM = "GPU"


class EngineEvents:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._batches: list[dict] = []

    def record(self, index: PrefixIndex, evictions: Sequence[Eviction], cached: Sequence[int],
               tier_events: Sequence[dict] = ()) -> None:
        """One batch: the pages' evictions, then the offload tiers' stores and removals (``tier_events``, media CPU
        and STORAGE), then the blocks cached in the pages."""
        events: list[dict] = []
        if evictions:
            events.append({"type": "BlockRemoved", "block_hashes": [e.hash for e in evictions], "medium": MEDIUM})
        events += tier_events
        run: dict | None = None
        for page in cached:
            h, parent = index.hash_of(page), index.parent_of(page)
            if run is not None and run["block_hashes"][-1] == parent:
                run["block_hashes"].append(h)
                run["token_ids"] += list(index.pool.tokens[page])
                continue
            run = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                   "token_ids": list(index.pool.tokens[page]), "block_size": self.block_size, "lora_id": None,
                   "medium": MEDIUM, "lora_name": None}
            events.append(run)
        self._batches.append({"ts": time.time(), "events": events, "data_parallel_rank": 0})

    def batches(self) -> list[dict]:
        return [{**b, "events": [dict(e) for e in b["events"]]} for b in self._batches]
