"""What a prefix cache looks like at one moment, as plain data (after a pool's request or an engine's event batch):
the block pool, the tree of cached prefixes, the free queue and the request that just ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# the states of a block in one frame
FREE = "free"        # holds nothing reusable: never written, or written and not cached (taken before cached ones)
CACHED = "cached"    # no request holds it, but it keeps its prefix (hash or tree node): a later request may hit it
HIT = "hit"          # held by this frame's request and found in the cache: not recomputed
WRITTEN = "written"  # held by this frame's request and computed by it (new keys and values)
EVICTED = "evicted"  # held a cached prefix that this frame dropped to make room (its slot may now be reused)
HELD = "held"        # held by a request still running (not this frame's), or stored in an engine (events)
STATES = (FREE, CACHED, HIT, WRITTEN, EVICTED, HELD)

#: why tokens were recomputed (RequestView.misses[i].kind)
MISS_KINDS = {
    "first-seen": "no earlier request began with these tokens",
    "shorter-than-block": "the tokens shared with an earlier request do not fill one block",
    "diverged": "this request's tokens differ from the cached ones at a token",
    "evicted": "the block was cached, then evicted under pressure",
    "template": "the chat template rendered an earlier turn differently from how it was generated",
    "no-state-checkpoint": "a recurrent layer's state was not saved at that position",
    "sliding-window": "the sliding-window layers hold no cached blocks where the hit would resume",
    "partial-block": "the last tokens do not fill a whole block (only full blocks are shared; the last prompt token "
                     "is always computed for its logits)",
}


@dataclass(frozen=True)
class BlockView:
    """One block of the pool (``slot``: its physical index; for an event stream, the order it was first stored in)."""

    slot: int
    state: str                      # one of STATES
    hash: str | None = None         # the block's prefix hash, short hex (None: not cached)
    parent: str | None = None       # the hash of the block before it in its prefix (None: first block)
    tokens: tuple[int, ...] = ()    # the token ids it holds (empty when free)
    text: str = ""                  # those tokens as text (empty without a tokenizer)
    refcount: int = 0               # requests holding it now
    stored_by: int | None = None    # the request (or event batch) that wrote it
    last_used: int | None = None    # the last request (or batch) that held it
    state_checkpoint: bool = False  # a recurrent state was saved at its end (hybrid models)
    node: str | None = None         # the tree node it belongs to
    evicted: str | None = None      # the hash of the cached block this frame evicted from it (then maybe reused)
    sliding_freed: bool = False     # a hybrid model's sliding-window layers freed their share of it (vLLM's rule)


@dataclass(frozen=True)
class TreeNode:
    """A node of the tree of cached prefixes. For the hash policy a node is one block (its parent: the block whose
    hash went into its own); for the radix policy a node is a run of blocks that no cached prefix splits."""

    id: str
    parent: str | None              # None: a child of the root (the empty prefix)
    start: int                      # position of its first token in the prefix
    tokens: tuple[int, ...]
    text: str
    slots: tuple[int, ...]          # the blocks holding it
    state: str                      # CACHED / HIT / WRITTEN / HELD, or EVICTED in the frame that dropped it
    hits: int = 0                   # requests that were served from it so far
    reachable: bool = True          # False: its parent was evicted, so no request can reach it (hash policy)


@dataclass(frozen=True)
class MissView:
    kind: str                       # a key of MISS_KINDS
    start: int                      # the recomputed token positions [start, end)
    end: int
    reason: str                     # in words, with the token and the request it refers to


@dataclass(frozen=True)
class RequestView:
    index: int
    label: str                      # a short name ("request 3", or the user's)
    prompt_tokens: int
    hit_tokens: int
    recomputed_tokens: int
    generated_tokens: int
    bytes_shared: int
    misses: tuple[MissView, ...]
    prompt: tuple[int, ...] = ()
    generated: tuple[int, ...] = ()
    text: str = ""                  # the prompt as text (empty without a tokenizer)


@dataclass(frozen=True)
class PoolFrame:
    index: int                      # 0: before any request (or event batch)
    title: str
    policy: str                     # "hash", "radix", or "events"
    block_size: int
    num_blocks: int                 # slots of the pool figure (for events: blocks ever stored, grown as they come)
    blocks: tuple[BlockView, ...]
    tree: tuple[TreeNode, ...]
    free_queue: tuple[int, ...]     # slots in the order they will be taken (first: next)
    request: RequestView | None = None
    notes: tuple[str, ...] = ()     # what happened in this frame, in words (evictions, events)
    bytes_per_block: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. {"dp_rank": 0, "medium": "GPU"} for events

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def count(self, state: str) -> int:
        return sum(1 for b in self.blocks if b.state == state)
