"""Prefill and decode apart (disaggregated serving): a prefill rank computes the prompt into its paged cache and sends
the pages to a decode rank, which installs them in its own paged cache and continues. The two sides first exchange
their page layouts (:class:`PageLayout`: heads-first or tokens-first blocks, the block length of each layer) and both
refuse a mismatch naming the two, before anything is computed or sent: read with the other side's layout, the bytes
would be another tensor (vLLM #22663, garbled output; #57661, hybrid layers at different block lengths). What crossed
is counted (:class:`Handoff`: bytes, pages, seconds)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..errors import SettingsError

ORDERS = ("heads-first", "tokens-first")  # a block as [kv_heads, block, head_dim] (vLLM's HND) or [block, ...] (NHD)


@dataclass(frozen=True)
class PageLayout:
    """How one side lays out a block of the transfer: ``order`` (heads-first or tokens-first) and ``block_size``,
    with ``layer_blocks`` giving the layers whose block length differs (a hybrid model's sliding layers)."""

    order: str = "heads-first"
    block_size: int = 16
    layer_blocks: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise SettingsError(f"page order {self.order!r} is not one of {', '.join(ORDERS)}")
        for size in (self.block_size, *self.layer_blocks.values()):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise SettingsError(f"a block length is a whole number of positions, 1 or more, got {size!r}")

    def block(self, layer: int) -> int:
        return self.layer_blocks.get(layer, self.block_size)

    def describe(self) -> str:
        own = ", ".join(f"layer {i}: blocks of {n}" for i, n in sorted(self.layer_blocks.items()))
        return f"{self.order} blocks of {self.block_size}" + (f" ({own})" if own else "")

    def mismatch(self, other: "PageLayout", layers: int) -> str | None:
        """Why pages laid out by ``self`` cannot be read as ``other`` lays them out (None: they can)."""
        if self.order != other.order:
            return f"the block order differs ({self.order} against {other.order})"
        differ = [i for i in range(layers) if self.block(i) != other.block(i)]
        if differ:
            i = differ[0]
            return (f"the block length of {len(differ)} layer{'s' * (len(differ) > 1)} differs (layer {i}: "
                    f"{self.block(i)} against {other.block(i)})")
        return None


def check_layouts(sender: PageLayout, receiver: PageLayout, layers: int) -> None:
    if why := sender.mismatch(receiver, layers):
        raise SettingsError(f"the prefill side sends {sender.describe()}; the decode side reads "
                            f"{receiver.describe()}: {why}. Give both sides one layout (a decode side reading "
                            f"another layout's bytes gets other tensors: garbled output)")


@dataclass
class Handoff:
    """What one prompt's transfer carried: ``positions``, ``pages`` (blocks sent, every layer, keys and values
    apart), ``bytes`` and ``seconds`` (the sends, measured on the prefill side)."""

    positions: int = 0
    pages: int = 0
    bytes: int = 0
    seconds: float = 0.0


def tokens_of(cache, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache's keys and values of ``layer`` for positions ``0..length-1``, ``(kv_heads, length, head_dim)``."""
    pages = cache.block_tables[0][:math.ceil(length / cache.block_size)]
    k, v = cache.pool.k[layer][pages], cache.pool.v[layer][pages]  # (pages, kv_heads, block, head_dim)
    flat = [t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[-1])[:, :length] for t in (k, v)]
    return flat[0], flat[1]


def to_blocks(x: torch.Tensor, block: int, order: str) -> torch.Tensor:
    """``(kv_heads, length, head_dim)`` as whole blocks in ``order`` (the last one padded with zeros)."""
    heads, length, width = x.shape
    n = math.ceil(length / block)
    padded = torch.zeros(heads, n * block, width, dtype=x.dtype, device=x.device)
    padded[:, :length] = x
    blocks = padded.view(heads, n, block, width).transpose(0, 1)  # (n, heads, block, width): heads-first
    return (blocks if order == "heads-first" else blocks.transpose(1, 2)).contiguous()


def from_blocks(blocks: torch.Tensor, length: int, order: str) -> torch.Tensor:
    """What :func:`to_blocks` packed, read back as ``(kv_heads, length, head_dim)``."""
    heads_first = blocks if order == "heads-first" else blocks.transpose(1, 2)
    n, heads, block, width = heads_first.shape
    return heads_first.transpose(0, 1).reshape(heads, n * block, width)[:, :length]


def send(cache, layout: PageLayout, length: int, to: int) -> Handoff:
    """The prefill side: every full layer's pages for ``length`` positions, in ``layout``, sent to rank ``to`` (each
    as its byte count, then its bytes: what the decode side makes of them is its reading's business)."""
    done = Handoff(positions=length)
    start = time.perf_counter()
    for layer in cache.full_layers:
        for x in tokens_of(cache, layer, length):
            blocks = to_blocks(x, layout.block(layer), layout.order)
            dist.send(torch.tensor([blocks.numel()]), dst=to)
            dist.send(blocks.reshape(-1), dst=to)
            done.pages += blocks.shape[0]
            done.bytes += blocks.nbytes
    done.seconds = time.perf_counter() - start
    return done


def read_as(layout: PageLayout):
    """How a decode side reads each layer's bytes: as ``layout`` says, layer by layer."""
    return lambda layer: (layout.order, layout.block(layer))


def agreed_reading(sender: PageLayout, receiver: PageLayout, layers: int, convert: bool):
    """kvexplore's reading (what :class:`~kvexplore.distributed.Disaggregated` names by default): both sides refuse a
    layout mismatch, naming the two (``convert``: the decode side reads the sender's layout instead); the bytes are
    then read as the sender laid them out. Both sides call it, so both refuse alike."""
    if not convert:
        check_layouts(sender, receiver, layers)
    return read_as(sender)


def receive(cache, length: int, source: int, reading) -> Handoff:
    """The decode side: every full layer's pages from rank ``source``, each read as ``reading(layer)`` says
    (``(order, block length)``), written into pages of ``cache`` (its own block size), which then holds positions
    ``0..length-1``. The bug zoo plants readings that do not follow the sender's layout."""
    if cache.length:
        cache.truncate(0)
    done = Handoff(positions=length)
    config, start = cache.config, time.perf_counter()
    pages = [cache.pool.free[-1 - i] for i in range(math.ceil(length / cache.block_size))]  # next taken first
    for layer in cache.full_layers:
        heads, width = config.layer_kv_heads(layer), config.layer_head_dim(layer)
        order, block = reading(layer)
        for store in (cache.pool.k[layer], cache.pool.v[layer]):
            size = torch.zeros(1, dtype=torch.long)
            dist.recv(size, src=source)
            flat = torch.empty(int(size), dtype=store.dtype, device=store.device)
            dist.recv(flat, src=source)
            n = math.ceil(length / block)
            shape = (n, heads, block, width) if order == "heads-first" else (n, block, heads, width)
            blocks = _fitted(flat, shape)
            done.pages, done.bytes = done.pages + n, done.bytes + flat.nbytes
            store[pages] = to_blocks(from_blocks(blocks, length, order), cache.block_size, "heads-first")
    cache.adopt(pages, length)
    done.seconds = time.perf_counter() - start
    return done


def _fitted(flat: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The bytes received as ``shape``: cut or zero-padded when the reading's block length is not the sender's (what
    a transfer registered with another layer's block length reads: truncated, misaligned)."""
    n = math.prod(shape)
    if flat.numel() >= n:
        return flat[:n].view(shape)
    return torch.cat([flat, flat.new_zeros(n - flat.numel())]).view(shape)
