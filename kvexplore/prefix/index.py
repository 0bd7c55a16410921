"""What both prefix policies answer over one block pool: the longest cached prefix of a request, what to cache, which
free page to take next (and what that evicts) and the tree of what is cached. Whatever the policy, every full block
is also named by its chain hash (:func:`block_hashes`), which keys the evictions and the engine-style events."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ROOT_HASH = hashlib.sha256(b"kvexplore prefix root").digest()  # the parent of every first block


def block_hashes(ids: Sequence[int], block_size: int, blocks: int | None = None,
                 known: Sequence[bytes] = ()) -> list[bytes]:
    """The chain hash of each full block of ``ids`` (the first ``blocks`` of them): ``sha256(parent || tokens)``
    with the tokens as little-endian int64; the first block's parent is :data:`ROOT_HASH`. ``known``: the chain of
    the leading blocks, already worked out (only the blocks after them are hashed)."""
    n = len(ids) // block_size if blocks is None else blocks
    if n <= len(known):
        return list(known[:n])
    arr = np.asarray(list(ids[: n * block_size]), dtype="<i8")
    out, parent = list(known), (known[-1] if known else ROOT_HASH)
    for i in range(len(known), n):
        parent = hashlib.sha256(parent + arr[i * block_size: (i + 1) * block_size].tobytes()).digest()
        out.append(parent)
    return out


def short(h: bytes | None) -> str | None:
    """A block hash as it is shown: its first 8 hex digits."""
    return None if h is None else h.hex()[:8]


@dataclass(frozen=True)
class Eviction:
    """A cached block dropped to make room: its chain hash, the page, the tokens it held, its parent's hash and the
    position of its first token."""

    hash: bytes
    page: int
    tokens: tuple[int, ...]
    parent: bytes | None = None
    start: int = 0


@dataclass(frozen=True)
class Node:
    """One node of the tree of cached prefixes, as the frames show it (see
    :class:`~kvexplore.prefix.frames.TreeNode`)."""

    id: str
    parent: str | None
    start: int
    pages: tuple[int, ...]
    reachable: bool = True


class PrefixIndex(ABC):
    """The cached prefixes over one pool's pages. ``pool`` is set by the pool that uses it (it reads the pool's
    reference counts); ``evictions`` collects what :meth:`victim` dropped until the pool reads it."""

    name = "index"
    #: how the policy picks the page to take, in words (for docs and the widget)
    taking = ""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.pool = None
        self.evictions: list[Eviction] = []

    @abstractmethod
    def match(self, ids: Sequence[int], hashes: list[bytes]) -> list[int]:
        """Pages holding the longest cached prefix of ``ids`` made of whole blocks (``hashes``: the chain hashes of
        the blocks that may be hit; a match never goes past them). Marks them used now."""

    @abstractmethod
    def insert(self, ids: Sequence[int], pages: list[int], hashes: list[bytes]) -> list[int]:
        """Cache the full blocks of ``ids`` that ``pages`` hold (one page per block, ``hashes`` their chain hashes);
        returns the pages newly cached (a block already cached on another page is not cached twice)."""

    @abstractmethod
    def victim(self, free: list[int]) -> int:
        """The free page to take next (``free``: the pool's free pages, in the order they came back). A page that
        holds a cached block is dropped from the index first (recorded in :attr:`evictions`)."""

    @abstractmethod
    def hash_of(self, page: int) -> bytes | None:
        """The chain hash of the block ``page`` caches (None: it caches nothing)."""

    @abstractmethod
    def parent_of(self, page: int) -> bytes | None:
        """The chain hash of the block before the one ``page`` caches (None: a first block, or nothing cached)."""

    @abstractmethod
    def nodes(self) -> list[Node]:
        """The tree of what is cached, parents before children."""

    def cached(self, page: int) -> bool:
        return self.hash_of(page) is not None
