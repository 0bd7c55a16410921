"""A terminal view of the cache: one line of slot symbols per step (:data:`LEGEND`), the counterpart of the cache map
widget; everything ``=``, ``+`` or shared is what attention reads this step, ``+`` what the step wrote."""

from __future__ import annotations

from collections.abc import Sequence

from ..caches.base import EVICTED, FILLED, FREE, SHARED, STALE, SlotView
from ..caches.memory import MemoryReport, format_bytes
from .records import StepRecord

LEGEND = ". free  = filled/read  + written this step  ~ stale  x evicted  2-9 shared by n sequences"
# when several slots share one symbol, the most telling state wins
_RANK = {"+": 6, "x": 5, "~": 4, "=": 3, ".": 0}


def slot_symbols(view: SlotView, written: set[int]) -> list[str]:
    """One symbol per physical slot; ``written`` holds the logical positions this step wrote."""
    out = []
    for state, position, sharers in zip(view.states, view.positions, view.sharers):
        if state in (FILLED, SHARED) and position in written:
            out.append("+")
        elif state == SHARED or (state == FILLED and sharers > 1):
            out.append(str(sharers) if sharers < 10 else "*")
        else:
            out.append({FREE: ".", FILLED: "=", STALE: "~", EVICTED: "x"}.get(state, "?"))
    return out


def cache_map(view: SlotView, written: set[int], width: int = 96) -> str:
    """``|...|`` of at most ``width`` symbols (each standing for ``ceil(slots / width)`` slots when wider)."""
    symbols = slot_symbols(view, written)
    if not symbols:
        return "|| (no storage)"
    per = -(-len(symbols) // width)
    groups = [symbols[i:i + per] for i in range(0, len(symbols), per)]
    line = "".join(max(g, key=lambda s: _RANK.get(s, 2)) for g in groups)  # shared digits: between stale and filled
    scale = f" 1 symbol = {per} slots" if per > 1 else ""
    return f"|{line}|{scale}"


def memory_line(m: MemoryReport) -> str:
    held = f"  held {format_bytes(m.held_bytes)}" if m.held_bytes and m.held_bytes != m.reserved_bytes else ""
    return (f"reserved {format_bytes(m.reserved_bytes)}{held}  logical {format_bytes(m.logical_bytes)}  "
            f"written {format_bytes(m.written_bytes)}"
            f"  copied {format_bytes(m.copied_bytes)}  allocated {format_bytes(m.allocated_bytes)} ({m.allocations})"
            f"  freed {format_bytes(m.freed_bytes)} ({m.frees})")


def step_view(record: StepRecord, views: SlotView | Sequence[SlotView], num_layers: int, width: int = 96) -> str:
    """The token, then one slot map per kind of layer cache (``views``: one per layer, as ``cache.inspect.slot_views()``
    gives, or one for all layers) and the step's memory on the first."""
    start = record.position - record.input_len
    written = set(range(start, record.position)) if record.cache_length else set()
    head = (f"#{record.step:<4d} {record.kind:7s} fed {start}..{record.position - 1} -> {record.text!r} "
            f"at {record.position} (p={record.prob:.2f})")
    per_layer = [views] * num_layers if isinstance(views, SlotView) else list(views)
    groups: dict[int, tuple[SlotView, list[int]]] = {}
    for layer, view in enumerate(per_layer):
        groups.setdefault(id(view), (view, []))[1].append(layer)
    mem = memory_line(record.memory) if record.memory is not None else ""
    lines = [head]
    for i, (view, layers) in enumerate(groups.values()):
        held = sum(s in (FILLED, SHARED) for s in view.states)
        slots = f"{held}/{len(view.states)} slots" if view.states else view.layout.summary() or "no cache"
        if len(layers) == 1:
            name = f"layer {layers[0]}"
        elif layers == list(range(layers[0], layers[-1] + 1)):
            name = f"layers {layers[0]}-{layers[-1]}"
        else:
            name = "layers " + ",".join(map(str, layers))
        body = cache_map(view, written, width) if view.states else ""
        lines.append(f"  {name}  {body}  {slots}" + (f"  {mem}" if i == 0 else ""))
    return "\n".join(lines)
