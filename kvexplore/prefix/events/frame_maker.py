"""One :class:`~kvexplore.prefix.frames.PoolFrame` of an engine cache after an event batch, the kind a
:class:`~kvexplore.prefix.pool.PrefixPool` makes, so that one view draws both (its states and tree: docs/prefix.md)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from .schema import Hash
from .state import Block, CacheState, Change, HashNames
from ..result import count
from ..frames import EVICTED, FREE, HELD, WRITTEN, BlockView, PoolFrame, TreeNode

MAX_NOTES = 24  # a batch of hundreds of events is summed up after this many notes


@dataclass
class FrameMaker:
    """Builds the frames of one cache, sharing what does not change between frames (text, block views)."""

    names: HashNames
    decode: Callable[[tuple[int, ...]], str] | None = None
    _text: dict[Hash, str] = field(default_factory=dict)
    _views: dict[tuple, BlockView] = field(default_factory=dict)
    _nodes: dict[tuple, TreeNode] = field(default_factory=dict)

    def text(self, block: Block) -> str:
        if self.decode is None:
            return ""
        if block.hash not in self._text:
            self._text[block.hash] = self.decode(block.tokens)
        return self._text[block.hash]

    def frame(self, state: CacheState, number: int, title: str, notes: list[str], meta: dict[str, Any],
              elsewhere: Collection = ()) -> PoolFrame:
        """``elsewhere``: hashes held in the same group's other media (a parent there keeps a block reachable)."""
        evicted = {b.slot: b for b in state.change.dropped}
        blocks = []
        for slot, h in enumerate(state.slots):
            block = state.blocks[h] if h is not None else evicted.get(slot)
            if block is None:
                blocks.append(self._view((slot, FREE), lambda: BlockView(slot=slot, state=FREE)))
                continue
            st = EVICTED if h is None else WRITTEN if block.stored_by == number else HELD
            blocks.append(self._view((slot, st, block.hash, block.stored_by, block.last_used), lambda: BlockView(
                slot=slot, state=st, hash=self.names(block.hash), parent=self.names(block.parent),
                tokens=block.tokens, text=self.text(block), stored_by=block.stored_by, last_used=block.last_used,
                node=self._node_id(block, st))))
        return PoolFrame(index=number, title=title, policy="events", block_size=state.block_size,
                         num_blocks=len(state.slots), blocks=tuple(blocks),
                         tree=self.tree(state, number, evicted, elsewhere),
                         free_queue=tuple(sorted(state.free)), notes=tuple(notes), meta=meta)

    def tree(self, state: CacheState, number: int, evicted: dict[int, Block],
             elsewhere: Collection = ()) -> tuple[TreeNode, ...]:
        reach = state.reachable(elsewhere)
        gone = {b.hash for b in evicted.values()}
        order = lambda b: (b.start, b.slot)  # noqa: E731
        live = [self._tree_node(b, WRITTEN if b.stored_by == number else HELD, reach[b.hash], state, gone)
                for b in sorted(state.blocks.values(), key=order)]
        dropped = [self._tree_node(b, EVICTED, False, state, gone) for b in sorted(evicted.values(), key=order)]
        return tuple(live + dropped)

    def _tree_node(self, block: Block, st: str, reachable: bool, state: CacheState, gone: set) -> TreeNode:
        p = block.parent
        x = p is not None and p in gone and p not in state.blocks
        key = (block.hash, block.stored_by, block.slot, st, reachable, x)
        node = self._nodes.get(key)
        if node is None:
            parent = None if p is None else ("x" if x else "") + self.names(p)
            node = self._nodes[key] = TreeNode(id=self._node_id(block, st), parent=parent, start=block.start,
                                               tokens=block.tokens, text=self.text(block), slots=(block.slot,),
                                               state=st, reachable=reachable)
        return node

    def _node_id(self, block: Block, st: str) -> str:
        return ("x" if st == EVICTED else "") + self.names(block.hash)

    def _view(self, key: tuple, make: Callable[[], BlockView]) -> BlockView:
        if key not in self._views:
            self._views[key] = make()
        return self._views[key]


def describe(change: Change, names: HashNames, held_in: Mapping[Hash, str] | None = None) -> list[str]:
    """What one batch did to one cache, in words, in the order it did it. ``held_in``: the medium holding each block
    of the same group's other media (an offload tier's parent is often in the pages)."""
    notes, held_in = [], held_in or {}
    for what, *rest in change.log:
        if what == "stored":
            ev, new, again, parent_held = rest
            where = "as a new prefix (no parent)" if ev.parent is None else f"under {names(ev.parent)}"
            if not parent_held and ev.parent in held_in:
                where += f", a block held in {held_in[ev.parent]}"
            elif not parent_held:
                where += ", a block this cache does not hold (removed, or stored before the stream began)"
            note = f"stored {count(len(ev.hashes), 'block')} ({len(ev.tokens)} tokens) {where}: " \
                   f"{_listed([b.hash for b in new], names)}"
            notes.append(note + (f"; {again} of them held already (stored again)" if again else "")
                         + (f"; LoRA {ev.lora}" if ev.lora else ""))
        elif what == "removed":
            gone, unknown = rest
            if gone:
                notes.append(f"removed {count(len(gone), 'block')}: {_listed([b.hash for b in gone], names)}")
            if unknown:
                notes.append(f"removed {count(len(unknown), 'block')} this stream never showed stored "
                             f"({_listed(unknown, names)}): stored before the recording began, or in a missing batch")
        else:
            notes.append(f"all blocks cleared ({count(rest[0], 'block')})")
    if change.no_tokens:
        notes.append(f"no token ids ({change.no_tokens}): the blocks are drawn without tokens or text")
    return notes + [f"token_ids do not fill the blocks exactly: {m}" for m in change.token_mismatch]


def capped(notes: list[str]) -> list[str]:
    if len(notes) <= MAX_NOTES:
        return notes
    return notes[:MAX_NOTES - 1] + [f"... and {len(notes) - MAX_NOTES + 1} more notes"]


def _listed(hashes: list[Hash], names: HashNames, most: int = 4) -> str:
    shown = ", ".join(names(h) for h in hashes[:most])
    return shown + (f" and {len(hashes) - most} more" if len(hashes) > most else "")
