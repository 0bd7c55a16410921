"""Offload tiers under a prefix pool, as vLLM's offloading connector and LMCache keep them: a cached block evicted from
the pool's pages (the device, ``GPU`` in vLLM's events) is copied to a host tier (``CPU``), whose least recently used
block moves on to a disk tier (``STORAGE``: one file per block) when the host is full; the disk's least recently used
block is dropped when the disk is full. A request whose prefix continues in a tier takes those blocks back into the
pool (copied up; the tier keeps its copy, as both engines' tiers are caches). Every move is counted in bytes and given
a modelled time from a named bandwidth (:class:`Link`: nothing here has a GPU or an NVMe disk to time)."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..core.settings import shown
from ..errors import SettingsError

GPU, CPU, STORAGE = "GPU", "CPU", "STORAGE"  # vLLM's medium names (vllm/v1/kv_offload/base.py Medium, and MEDIUM_GPU)


@dataclass(frozen=True)
class Link:
    """A modelled transfer rate between two tiers: ``bytes_per_second`` one way, and where the figure comes from."""

    name: str
    bytes_per_second: float
    source: str

    def seconds(self, nbytes: int) -> float:
        return nbytes / self.bytes_per_second

    def then(self, other: "Link") -> "Link":
        """This link and ``other`` one after the other (a copy crossing both): their times add."""
        rate = 1 / (1 / self.bytes_per_second + 1 / other.bytes_per_second)
        return Link(f"{self.name} + {other.name}", rate, f"{self.source}; {other.source}")


#: host <-> device: PCIe 4.0 x16, 16 GT/s x 16 lanes with 128b/130b coding = 31.5 GB/s each way
PCIE4_X16 = Link("PCIe 4.0 x16", 31.5e9, "PCI-SIG, PCI Express Base Specification 4.0: 16 GT/s per lane, 128b/130b")
#: disk <-> memory: a PCIe 4.0 NVMe SSD's sequential read (its write is 6.9 GB/s)
NVME_GEN4 = Link("NVMe PCIe 4.0 SSD", 7.45e9, "Samsung 990 PRO data sheet: 7,450 MB/s sequential read")


@dataclass(frozen=True)
class Offload:
    """The tiers under a :class:`~kvexplore.prefix.pool.PrefixPool`: ``host_blocks`` blocks of host memory, then
    ``disk_blocks`` files in ``directory`` (None: a temporary folder removed with the pool). ``host_link`` and
    ``disk_link`` model the moves' time."""

    host_blocks: int = 0
    disk_blocks: int = 0
    directory: str | Path | None = None
    host_link: Link = PCIE4_X16
    disk_link: Link = NVME_GEN4

    def __post_init__(self) -> None:
        for name in ("host_blocks", "disk_blocks"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise SettingsError(f"Offload({name}=...) is a number of blocks (an int >= 0), got {shown(n)}")
        if not self.host_blocks and not self.disk_blocks:
            raise SettingsError("Offload() with neither host_blocks nor disk_blocks has nowhere to put an evicted "
                                "block: give host_blocks (host memory) and/or disk_blocks (files)")
        for name in ("host_link", "disk_link"):
            if not isinstance(getattr(self, name), Link):
                raise SettingsError(f"Offload({name}=...) is a kvexplore.prefix.tiers.Link (name, bytes per "
                                    f"second, source), got {shown(getattr(self, name))}")


@dataclass(frozen=True)
class TierBlock:
    """What a tier keeps of a block besides its bytes: its chain hash, its parent's, its tokens and its index."""

    hash: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    index: int


@dataclass(frozen=True)
class Move:
    """One block copied from ``source`` to ``target`` (a medium; ``target`` None: dropped from ``source``)."""

    hash: bytes
    source: str
    target: str | None
    nbytes: int
    seconds: float  # modelled, from the link's bandwidth (0 for a drop)
    link: str = ""


def page_data(pool, page: int) -> torch.Tensor:
    """The bytes of ``page`` of a :class:`~kvexplore.caches.layers.paged_layer.PagePool`: every paged layer's keys,
    then values, in layer order (a copy)."""
    return torch.cat([t[page].reshape(-1).view(torch.uint8) for t in pool.tensors()])


def write_page_data(pool, page: int, data: torch.Tensor) -> None:
    """Put bytes :func:`page_data` gave back into ``page``."""
    at = 0
    for t in pool.tensors():
        n = t[page].nbytes
        t[page].copy_(data[at: at + n].view(t.dtype).view(t[page].shape))
        at += n


class Tiers:
    """The host and disk tiers of one pool: blocks by chain hash, least recently used first. ``page_bytes``: the
    bytes of one block (every paged layer's keys and values)."""

    def __init__(self, offload: Offload, page_bytes: int) -> None:
        self.offload, self.page_bytes = offload, page_bytes
        self.host = torch.zeros((offload.host_blocks, page_bytes), dtype=torch.uint8)  # the host tier's memory
        self._host: OrderedDict[bytes, tuple[int, TierBlock]] = OrderedDict()  # hash -> (row, block), LRU first
        self._free_rows = list(range(offload.host_blocks))
        self._disk: OrderedDict[bytes, TierBlock] = OrderedDict()
        if offload.disk_blocks and offload.directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="kvexplore-tier-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.directory), True)
        else:
            self.directory = None if offload.directory is None else Path(offload.directory)
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
        self.moves: list[Move] = []     # every move so far
        self.events: list[dict] = []    # the KV events of the moves since the pool last took them
        self._dropped: list[tuple[bytes, str]] = []  # (block, tier) dropped since the pool last asked

    # -- where blocks are ----------------------------------------------------------------------------------
    def medium_of(self, h: bytes) -> str | None:
        """The fastest tier holding block ``h`` (None: neither)."""
        return CPU if h in self._host else STORAGE if h in self._disk else None

    def blocks(self, medium: str) -> list[TierBlock]:
        """The blocks a tier holds, least recently used first."""
        return [b for _, b in self._host.values()] if medium == CPU else list(self._disk.values())

    def capacity(self, medium: str) -> int:
        return self.offload.host_blocks if medium == CPU else self.offload.disk_blocks

    def counts(self) -> dict[str, dict[str, int]]:
        """Per tier: blocks held, capacity, bytes (the host: its whole buffer; the disk: its files)."""
        return {m: {"blocks": len(self.blocks(m)), "capacity": self.capacity(m),
                    "bytes": self.host_bytes if m == CPU else self.disk_bytes} for m in (CPU, STORAGE)}

    def file_of(self, h: bytes) -> Path:
        return self.directory / f"{h.hex()}.kvblock"

    @property
    def host_bytes(self) -> int:
        """Host memory the tier holds (all its rows, used or not)."""
        return self.host.nbytes

    @property
    def disk_bytes(self) -> int:
        """Bytes of the block files on disk now."""
        return len(self._disk) * self.page_bytes

    # -- moving blocks ---------------------------------------------------------------------------------------
    def spill(self, block: TierBlock, data: torch.Tensor) -> None:
        """A block evicted from the device (``data``: its ``page_bytes`` bytes) goes to the host tier, or to the disk
        tier without one; a block the tier still holds is only marked used (its bytes are there already)."""
        if (where := self.medium_of(block.hash)) is not None:
            self._touch(block.hash, where)
            return
        if self.offload.host_blocks:
            self._put_host(block, data, GPU)
        elif self.offload.disk_blocks:
            self._put_disk(block, data, GPU, self.offload.host_link)

    def fetch(self, h: bytes) -> tuple[torch.Tensor, str]:
        """Block ``h``'s bytes from the fastest tier holding it, copied up to the device (the tier keeps its copy,
        marked used), and that tier's medium."""
        where = self.medium_of(h)
        if where == CPU:
            row, _ = self._host[h]
            data = self.host[row].clone()
            link = self.offload.host_link
        elif where == STORAGE:
            data = torch.from_numpy(np.fromfile(self.file_of(h), dtype=np.uint8))
            if data.numel() != self.page_bytes:
                raise SettingsError(f"the tier file {self.file_of(h)} holds {data.numel()} bytes, a block is "
                                    f"{self.page_bytes}: was it written by another pool or model? Give each pool its "
                                    f"own Offload(directory=...)")
            link = self.offload.disk_link.then(self.offload.host_link)  # disk to host memory, then to the device
        else:
            raise SettingsError(f"block {h.hex()[:8]} is in no tier")
        self._touch(h, where)
        self._move(h, where, GPU, link)
        return data, where

    def _put_host(self, block: TierBlock, data: torch.Tensor, source: str) -> None:
        if not self._free_rows:  # the least recently used host block moves down (or is dropped)
            old, (row, victim) = next(iter(self._host.items()))
            if self.offload.disk_blocks:
                self._put_disk(victim, self.host[row], CPU, self.offload.disk_link)
            self._drop(old, CPU)
        row = self._free_rows.pop(0)
        self.host[row].copy_(data)
        self._host[block.hash] = (row, block)
        self._stored(block, CPU)
        self._move(block.hash, source, CPU, self.offload.host_link)

    def _put_disk(self, block: TierBlock, data: torch.Tensor, source: str, link: Link) -> None:
        if block.hash in self._disk:
            self._disk.move_to_end(block.hash)
            return
        if len(self._disk) >= self.offload.disk_blocks:
            old = next(iter(self._disk))
            self.file_of(old).unlink(missing_ok=True)
            self._drop(old, STORAGE)
        data.numpy().tofile(self.file_of(block.hash))
        self._disk[block.hash] = block
        self._stored(block, STORAGE)
        self._move(block.hash, source, STORAGE, link)

    def _drop(self, h: bytes, medium: str) -> None:
        if medium == CPU:
            row, _ = self._host.pop(h)
            self._free_rows.append(row)
        else:
            self._disk.pop(h)
        self.events.append({"type": "BlockRemoved", "block_hashes": [h], "medium": medium})
        self.moves.append(Move(h, medium, None, 0, 0.0))
        self._dropped.append((h, medium))

    def _touch(self, h: bytes, medium: str) -> None:
        (self._host if medium == CPU else self._disk).move_to_end(h)

    def _stored(self, block: TierBlock, medium: str) -> None:
        self.events.append({"type": "BlockStored", "block_hashes": [block.hash], "parent_block_hash": block.parent,
                            "token_ids": list(block.tokens), "block_size": len(block.tokens), "lora_id": None,
                            "medium": medium, "lora_name": None})

    def _move(self, h: bytes, source: str, target: str, link: Link) -> None:
        self.moves.append(Move(h, source, target, self.page_bytes, link.seconds(self.page_bytes), link.name))

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    def take_dropped(self) -> list[tuple[bytes, str]]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def __repr__(self) -> str:
        o = self.offload
        return (f"Tiers(CPU {len(self._host)}/{o.host_blocks} blocks, STORAGE {len(self._disk)}/{o.disk_blocks} "
                f"blocks, {len(self.moves)} moves)")
