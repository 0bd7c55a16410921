"""How one layer cache arranges its physical slots, as typed values the views draw without knowing the strategy. Every
:class:`~kvexplore.caches.SlotView` carries one :class:`Layout`. A layout says, in plain data, what the cache map needs
beyond the slot states: how to read the x axis (``order``), a line of text for the title (:meth:`Layout.summary`),
vertical marks between slots (:meth:`Layout.marks`) and tick labels (:meth:`Layout.ticks`). A new strategy or layer type
adds a layout here and nothing in the explorer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.runs import runs


@dataclass(frozen=True)
class Mark:
    """A vertical line before slot ``at`` (drawn at ``at - 0.5``), with an optional label above it."""

    at: int
    label: str = ""
    colour: str = "#444"
    dash: str = "solid"


@dataclass(frozen=True)
class Layout:
    """Slots in storage order: slot ``i`` holds position ``i`` (the pre-allocated and concatenating caches)."""

    order = "storage order: slot i holds position i"

    def summary(self) -> str:
        return ""

    def marks(self, slots: int) -> list[Mark]:
        return []

    def ticks(self, slots: int) -> tuple[list[float], list[str]] | None:
        return None

    def step(self, write: tuple[int, int], read: int, view: bool = True) -> str:
        """What a step did, for the title: ``write`` (first position, count), the keys read (``view``: not gathered)."""
        w0, wn = write
        if wn == 0:
            return f"wrote nothing · attention read {read} positions"
        wrote = f"position {w0}" if wn == 1 else f"positions {w0}..{w0 + wn - 1}"
        return f"wrote {wrote} · attention read {read} positions"

    def to_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **asdict(self)}


@dataclass(frozen=True)
class LinearLayout(Layout):
    """Storage allocated once and written in place: the step's windows are literally ``narrow()`` views."""

    def step(self, write: tuple[int, int], read: int, view: bool = True) -> str:
        if not view:  # a sparse read (DeepSeek-V3.2): only the positions chosen, gathered
            return f"write narrow(2, {write[0]}, {write[1]}) · read a gather of {read} positions"
        return f"write narrow(2, {write[0]}, {write[1]}) · read narrow(2, 0, {read})"


@dataclass(frozen=True)
class GrowingLayout(Layout):
    """A cache that is exactly as long as the sequence (concatenation): a new, longer tensor every step."""

    order = "grows by one slot every step"


@dataclass(frozen=True)
class EmptyLayout(Layout):
    """No storage: nothing survives a step (no cache at all)."""

    order = "nothing is stored"


TABLE_RUNS = 6  # runs of pages a paged cache's one-line summary names before it counts the rest


def page_runs(pages: Sequence[int], most: int = TABLE_RUNS) -> str:
    """``[0, 1, 2, 3, 7, 8, 5]`` as ``"[0–3, 7–8, 5] (7 pages)"``: runs of consecutive pages, the first ``most`` of
    them, then how many pages the rest hold."""
    found = runs(pages)
    text = ", ".join(f"{a}" if a == b else f"{a}–{b}" for a, b in found[:most])
    rest = sum(b - a + 1 for a, b in found[most:])
    if rest:
        text += f", … {rest} more"
    return f"[{text}] ({len(pages)} page{'s' * (len(pages) != 1)})"


@dataclass(frozen=True)
class PagedLayout(Layout):
    block_size: int = 16
    block_table: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    free_blocks: int = 0

    order = "pool pages in order"

    def summary(self) -> str:
        """The block table as runs of consecutive pages, at most :data:`TABLE_RUNS` of them (a long prompt's table
        has hundreds of pages: ``block_table`` holds it whole, and the cache map's x axis names the pages)."""
        return f"block table {page_runs(self.block_table)} · {self.free_blocks} free pages"

    def marks(self, slots: int) -> list[Mark]:
        return [Mark(p * self.block_size, colour="#888") for p in range(1, slots // self.block_size)]

    def ticks(self, slots: int) -> tuple[list[float], list[str]]:
        bs = self.block_size
        pages = slots // bs
        every = max(1, pages // 16)
        return ([p * bs + (bs - 1) / 2 for p in range(0, pages, every)],
                [f"page {p}" for p in range(0, pages, every)])


@dataclass(frozen=True)
class RingLayout(Layout):
    """``sinks`` fixed slots, then a ring of ``window`` slots written round and round (StreamingLLM sinks, or a
    sliding-window layer with ``sinks == 0``). ``ring_start``: the slot of the oldest position in the ring;
    ``write_slot``: where the next position goes; ``evicted``: positions dropped so far."""

    sinks: int = 0
    window: int = 0
    ring_start: int = 0
    write_slot: int = 0
    evicted: int = 0

    @property
    def order(self) -> str:  # type: ignore[override]
        return "sinks, then the ring" if self.sinks else "a ring: position p in slot p mod window"

    def summary(self) -> str:
        head = f"{self.sinks} sinks + ring of {self.window}" if self.sinks else f"ring of {self.window}"
        return f"{head} · next write slot {self.write_slot} · {self.evicted} evicted"

    def marks(self, slots: int) -> list[Mark]:
        out = [Mark(self.sinks)] if self.sinks else []
        out.append(Mark(self.ring_start, "oldest", "#d62728", "dot"))
        return out


@dataclass(frozen=True)
class QuantizedLayout(Layout):
    bits: int = 8  # the keys' (and, without value_bits, the values') code width
    value_bits: int | None = None
    group_size: int = 32
    residual_window: int = 32
    quantized_upto: int = 0
    quantized_slots: int = 0
    residual: list[int] = field(default_factory=list)
    scheme: str = ""  # what the layer does beyond KIVI's axes (other axes, pre-RoPE keys, a rotation, outliers)

    order = "quantized slots, then full-precision residual"

    def summary(self) -> str:
        width = (f"int{self.bits}" if self.value_bits in (None, self.bits) else
                 f"K int{self.bits} / V int{self.value_bits}")
        extra = f" · {self.scheme}" if self.scheme else ""
        return f"{width} blocks of {self.group_size}{extra} · positions < {self.quantized_upto} quantized"

    def marks(self, slots: int) -> list[Mark]:
        return [Mark(self.quantized_slots, "full-precision residual →")]


@dataclass(frozen=True)
class SharedLayout(Layout):
    """A layer that stores nothing and reads layer ``source``'s cache (Gemma 4's KV sharing)."""

    source: int = 0

    order = "no slots of its own"

    def summary(self) -> str:
        return f"stores nothing, reads layer {self.source}"


@dataclass(frozen=True)
class StateLayout(Layout):
    """A linear-attention layer (Qwen3-Next): no slots, a fixed block of state that a step rewrites in place."""

    conv_bytes: int = 0
    recurrent_bytes: int = 0
    shape: list[int] = field(default_factory=list)  # (value heads, key dim, value dim) of the recurrent state

    order = "no slots: a fixed-size state"

    def summary(self) -> str:
        heads = "x".join(map(str, self.shape))
        return f"a fixed state of {self.conv_bytes + self.recurrent_bytes} B (recurrent {heads}), rewritten each step"


@dataclass(frozen=True)
class TransformersLayout(Layout):
    """A layer of a transformers ``Cache`` (kvexplore.hf): its class, whether the step left its keys in a new
    storage (``moved``: a concatenation) and, for a window, how many slots it keeps. Slots are in storage order."""

    layer_class: str = ""
    moved: bool = False
    window: int = 0
    capacity: int = 0

    @property
    def order(self) -> str:  # type: ignore[override]
        if self.window:
            return f"the last {self.window} positions, oldest first"
        return "grows by torch.cat every step" if not self.capacity else "storage order: slot i holds position i"

    def summary(self) -> str:
        where = "a new storage this step (copied)" if self.moved else "the same storage as before"
        return f"transformers {self.layer_class} · {where}"

    def step(self, write: tuple[int, int], read: int, view: bool = True) -> str:
        w0, wn = write
        how = "cat" if self.moved else "in place"
        return f"wrote {wn} at position {w0} ({how}) · attention read {read} keys"


@dataclass(frozen=True)
class CompactLayout(Layout):
    """An evicting cache's compacted storage: each head's kept positions packed at the front of its storage, then
    free slots (in position order after a prompt's press; a press while decoding fills the evicted slots with the
    kept ones after them)."""

    order = "per head: kept positions packed at the front, then free slots"


LAYOUTS = {cls.__name__: cls for cls in (LinearLayout, GrowingLayout, EmptyLayout, PagedLayout, RingLayout,
                                         QuantizedLayout, SharedLayout, StateLayout,
                                         TransformersLayout, CompactLayout)}


def layout_from_dict(d: dict[str, Any]) -> Layout:
    """Inverse of :meth:`Layout.to_dict` (for saved traces)."""
    d = dict(d)
    return LAYOUTS[d.pop("type")](**d)
