"""SGLang's RadixAttention over a pool: a radix tree whose edges are runs of whole blocks; uncached free pages are
taken first, then the least recently used leaf is evicted whole (docs/prefix.md)."""

from __future__ import annotations

from collections.abc import Sequence

from .index import Eviction, Node, PrefixIndex


class _Node:
    __slots__ = ("id", "parent", "start", "blocks", "pages", "hashes", "children", "used")

    def __init__(self, id: int, parent: "_Node | None", start: int) -> None:
        self.id, self.parent, self.start = id, parent, start
        self.blocks: list[tuple[int, ...]] = []
        self.pages: list[int] = []
        self.hashes: list[bytes] = []
        self.children: dict[tuple[int, ...], _Node] = {}
        self.used = 0


class RadixIndex(PrefixIndex):
    name = "radix"
    taking = ("a free page that caches nothing first; only when none is left, the least recently used leaf of the "
              "tree is evicted whole")

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.root = _Node(0, None, 0)
        self.by_page: dict[int, tuple[_Node, int]] = {}  # page -> (its node, its block's index in the node)
        self.clock = 0
        self._ids = 1

    def _blocks(self, ids: Sequence[int], n: int) -> list[tuple[int, ...]]:
        bs = self.block_size
        return [tuple(ids[i * bs: (i + 1) * bs]) for i in range(n)]

    def _walk(self, blocks: list[tuple[int, ...]], hashes: list[bytes]) -> tuple[_Node, int, list[int]]:
        """Follow ``blocks`` down the tree, splitting a node where the match ends inside it: (the last node
        matched, blocks matched, their pages). Every node on the way is marked used now."""
        self.clock += 1
        node, i, pages = self.root, 0, []
        while i < len(blocks) and (child := node.children.get(blocks[i])) is not None:
            k = 0
            while k < len(child.blocks) and i + k < len(blocks) and child.blocks[k] == blocks[i + k]:
                k += 1
            if k < len(child.blocks):
                child = self._split(child, k)
            child.used = self.clock
            pages += child.pages
            node, i = child, i + k
        return node, i, pages

    def _split(self, node: _Node, k: int) -> _Node:
        """Cut ``node`` after its first ``k`` blocks: the new upper node takes them, ``node`` keeps the rest."""
        upper = _Node(self._ids, node.parent, node.start)
        self._ids += 1
        upper.blocks, upper.pages, upper.hashes = node.blocks[:k], node.pages[:k], node.hashes[:k]
        upper.used = node.used
        node.blocks, node.pages, node.hashes = node.blocks[k:], node.pages[k:], node.hashes[k:]
        node.start += k * self.block_size
        node.parent.children[upper.blocks[0]] = upper
        upper.children[node.blocks[0]] = node
        node.parent = upper
        self._index(upper)
        self._index(node)
        return upper

    def _index(self, node: _Node) -> None:
        for j, page in enumerate(node.pages):
            self.by_page[page] = (node, j)

    def match(self, ids: Sequence[int], hashes: list[bytes]) -> list[int]:
        return self._walk(self._blocks(ids, len(hashes)), hashes)[2]

    def insert(self, ids: Sequence[int], pages: list[int], hashes: list[bytes]) -> list[int]:
        blocks = self._blocks(ids, len(hashes))
        node, i, _ = self._walk(blocks, hashes)
        if i == len(blocks):
            return []
        new = [p for p in pages[i:] if p not in self.by_page]
        if len(new) < len(pages) - i:  # a page of this request caches another block already: keep the tree as is
            return []
        leaf = _Node(self._ids, node, i * self.block_size)
        self._ids += 1
        leaf.blocks, leaf.pages, leaf.hashes, leaf.used = blocks[i:], list(pages[i:]), list(hashes[i:]), self.clock
        node.children[blocks[i]] = leaf
        self._index(leaf)
        return list(pages[i:])

    def victim(self, free: list[int]) -> int:
        for page in free:
            if page not in self.by_page:
                return page
        leaf = min(self._leaves(), key=lambda n: (n.used, n.id))
        del leaf.parent.children[leaf.blocks[0]]
        parent = leaf.parent.hashes[-1] if leaf.parent is not self.root else None
        for j, (page, h, tokens) in enumerate(zip(leaf.pages, leaf.hashes, leaf.blocks)):
            del self.by_page[page]
            self.evictions.append(Eviction(h, page, tokens, parent, leaf.start + j * self.block_size))
            parent = h
        gone = set(leaf.pages)
        return next(p for p in free if p in gone)

    def _leaves(self) -> list[_Node]:
        refcount = self.pool.refcount
        nodes = {id(n): n for n, _ in self.by_page.values()}.values()
        return [n for n in nodes if not n.children and all(refcount[p] == 0 for p in n.pages)]

    def hash_of(self, page: int) -> bytes | None:
        entry = self.by_page.get(page)
        return None if entry is None else entry[0].hashes[entry[1]]

    def parent_of(self, page: int) -> bytes | None:
        entry = self.by_page.get(page)
        if entry is None:
            return None
        node, j = entry
        if j:
            return node.hashes[j - 1]
        return node.parent.hashes[-1] if node.parent is not self.root else None

    def nodes(self) -> list[Node]:
        out, todo = [], list(self.root.children.values())
        while todo:
            node = todo.pop(0)
            parent = None if node.parent is self.root else f"n{node.parent.id}"
            out.append(Node(f"n{node.id}", parent, node.start, tuple(node.pages)))
            todo += sorted(node.children.values(), key=lambda n: n.id)
        return out
