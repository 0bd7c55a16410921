"""One engine cache as its events left it: the blocks stored now, the slots they sit in (given in the order the
blocks were stored: docs/prefix.md) and what the batch being applied changed."""

from __future__ import annotations

import heapq
from collections.abc import Collection
from dataclasses import dataclass, field

from .schema import NO_TOKENS, Hash, Removed, Stored, hash_hex

SHORT = 8  # hex digits shown of a hash (as the pool shows its own)


class HashNames:
    """Short hex names for hashes, stable over a replay: the first 8 hex digits, longer where two hashes share
    them (the later one gets more digits), so that a name stands for one hash."""

    def __init__(self) -> None:
        self._names: dict[Hash, str] = {}
        self._taken: dict[str, Hash] = {}

    def __call__(self, h: Hash | None) -> str | None:
        if h is None:
            return None
        name = self._names.get(h)
        if name is None:
            full = hash_hex(h)
            n, name = SHORT, full[:SHORT]
            while name in self._taken:
                n += 2
                name = full[:n] if n <= len(full) else f"{full}#{n - len(full)}"
            self._names[h], self._taken[name] = name, h
        return name

    def full(self, name: str) -> Hash | None:
        """The hash a short name stands for (bytes or int, as the engine sent it)."""
        return self._taken.get(name)


@dataclass
class Block:
    hash: Hash
    parent: Hash | None
    tokens: tuple[int, ...]
    slot: int
    start: int                  # its first token's position in its prefix (counted from the first block this
    # stream showed of it, when the stream never showed its parent stored)
    stored_by: int              # the batch (frame index) that stored it
    last_used: int              # the last batch that stored it (vLLM stores a block again after a reset or an offload)
    lora: str | None = None


@dataclass
class Change:
    """What one batch did to one cache, in the order it did it: ``log`` entries are ``("stored", event, new blocks,
    how many it held already, whether it held the parent)``, ``("removed", blocks, hashes it did not hold)`` and
    ``("cleared", blocks dropped)``."""

    log: list[tuple] = field(default_factory=list)
    dropped: list[Block] = field(default_factory=list)   # by BlockRemoved or AllBlocksCleared: shown evicted
    token_mismatch: list[str] = field(default_factory=list)
    no_tokens: str | None = None  # why the stores of this batch carry no token ids (the engine does not send them)

    @property
    def empty(self) -> bool:
        return not self.log


class CacheState:
    def __init__(self) -> None:
        self.blocks: dict[Hash, Block] = {}
        self.slots: list[Hash | None] = []       # slot -> the hash it holds
        self.free: list[int] = []                # a heap: the lowest free slot is taken first
        self.block_size = 0
        self.spec_kind: str | None = None  # what the engine says this group's layers are (vLLM's kv_cache_spec_kind)
        self.starts: dict[Hash, int] = {}  # every hash ever stored -> its start (for the blocks stored under it)
        self.totals = {"stored": 0, "removed": 0, "cleared": 0, "cleared_blocks": 0, "unknown_removed": 0}
        self.change = Change()
        self._pending_free: list[int] = []

    def begin(self) -> None:
        """A new batch: slots emptied by the last one become free."""
        for slot in self._pending_free:
            heapq.heappush(self.free, slot)
        self._pending_free = []
        self.change = Change()

    def store(self, ev: Stored, batch: int) -> None:
        bs = ev.block_size
        self.block_size = self.block_size or bs
        self.spec_kind = self.spec_kind or ev.extra.get("kv_cache_spec_kind")
        n = len(ev.hashes)
        tokens = ev.tokens
        if NO_TOKENS in ev.extra:  # an engine that sends no token ids (Dynamo): blocks without tokens
            self.change.no_tokens = ev.extra[NO_TOKENS]
        elif len(tokens) != n * bs:
            tail = len(tokens) > n * bs and len(tokens) % bs == 0
            self.change.token_mismatch.append(
                f"{len(tokens)} token ids for {n} blocks of {bs}" + (
                    ": the blocks' tokens taken from the end (vLLM 0.32's sliding-window groups send the token ids "
                    "of every block the step cached and the hashes of the ones they keep)" if tail else ""))
            if tail:
                tokens = tokens[len(tokens) - n * bs:]
        parent, new, again = ev.parent, [], 0
        parent_held = parent is None or parent in self.blocks
        step = self.block_size or 1  # no block size given (Dynamo's events lack it): positions count blocks
        start = self.starts[parent] + step if parent in self.starts else 0
        for i, h in enumerate(ev.hashes):
            mine = tuple(tokens[i * bs:(i + 1) * bs])
            held = self.blocks.get(h)
            if held is not None:
                held.last_used, again = batch, again + 1
            else:
                slot = heapq.heappop(self.free) if self.free else self._grow()
                block = Block(h, parent, mine, slot, start, batch, batch, ev.lora)
                self.blocks[h], self.slots[slot] = block, h
                new.append(block)
            self.starts[h] = start
            parent, start = h, start + (bs or 1)
        self.totals["stored"] += len(new)
        self.change.log.append(("stored", ev, new, again, parent_held))

    def remove(self, ev: Removed) -> None:
        gone, unknown = [], []
        for h in ev.hashes:
            block = self.blocks.pop(h, None)
            if block is None:
                unknown.append(h)
            else:
                self._drop(block)
                gone.append(block)
        self.totals["removed"] += len(gone)
        self.totals["unknown_removed"] += len(unknown)
        self.change.log.append(("removed", gone, unknown))

    def clear(self) -> None:
        dropped = list(self.blocks.values())
        for block in dropped:
            self._drop(block)
        self.blocks.clear()
        self.change.log.append(("cleared", len(dropped)))
        self.totals["cleared"] += 1
        self.totals["cleared_blocks"] += len(dropped)

    def depth(self) -> int:
        """The longest chain of stored blocks, each the parent of the next (in blocks)."""
        memo: dict[Hash, int] = {}
        for h in self.blocks:
            chain, stop = self._walk(h, memo)
            base = memo.get(stop, 0)
            memo.update((x, base + k) for k, x in enumerate(reversed(chain), 1))
        return max(memo.values(), default=0)

    def reachable(self, elsewhere: Collection = ()) -> dict[Hash, bool]:
        """Whether each stored block's chain of parents is stored all the way to a first block, or to a block held
        ``elsewhere`` (another medium of the same group: a lookup continues from one tier into the next)."""
        out: dict[Hash, bool] = {}
        for h in self.blocks:
            chain, stop = self._walk(h, out)
            ok = stop is None or out.get(stop, False) or stop in elsewhere
            out.update((x, ok) for x in chain)
        return out

    def _walk(self, h: Hash | None, known: dict) -> tuple[list[Hash], Hash | None]:
        """The stored blocks from ``h`` up its parents, stopping at the root (None), a block in ``known``, a hash not
        stored, or a loop (a damaged stream): ``(chain, where it stopped)``."""
        chain, seen = [], set()
        while h is not None and h in self.blocks and h not in known and h not in seen:
            chain.append(h)
            seen.add(h)
            h = self.blocks[h].parent
        return chain, h

    def _grow(self) -> int:
        self.slots.append(None)
        return len(self.slots) - 1

    def _drop(self, block: Block) -> None:
        self.slots[block.slot] = None
        self._pending_free.append(block.slot)
        self.change.dropped.append(block)
