"""A cached pass against the full recomputation, layer by layer: where do they first depart, and by how much."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..trace.parting import first_parting
from .passes import LayerPass, Pass


@dataclass(frozen=True)
class Departure:
    """One comparison: ``what`` ("keys", "values", "state", "output", "logits") of ``layer`` (None: logits) at
    ``position``, ``max_diff`` absolute and ``relative`` (to the reference's largest magnitude)."""

    what: str
    layer: int | None
    position: int | None
    max_diff: float
    relative: float


def _rel(diff: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    if diff.numel() == 0:
        return 0.0, 0.0
    top = float(diff.max())
    return top, top / max(float(ref.abs().max()), 1e-6)


def columns(got: LayerPass, ref: LayerPass) -> tuple[list[int], list[int], list[int]]:
    """Column indices of the positions both passes hold, (got's, ref's, positions)."""
    where = {p: j for j, p in enumerate(ref.positions)}
    pairs = [(i, where[p], p) for i, p in enumerate(got.positions) if p in where]
    return [a for a, _, _ in pairs], [b for _, b, _ in pairs], [p for _, _, p in pairs]


def kv_departure(what: str, layer: int, got: torch.Tensor, ref: torch.Tensor, gi: list[int], ri: list[int],
                 positions: list[int]) -> Departure:
    """The worst difference between two (heads, columns, dim) tensors over matching columns, and its position."""
    if not positions:
        return Departure(what, layer, None, 0.0, 0.0)
    g, r = got[:, gi], ref[:, ri]
    if g.shape != r.shape:  # the cache keeps another shape than the model writes: every position departs
        return Departure(what, layer, positions[0], float("inf"), float("inf"))
    diff = (g - r).abs().amax(dim=(0, 2))  # per column
    top, rel = _rel(diff, r)
    return Departure(what, layer, positions[int(diff.argmax())], top, rel)


def head_departure(what: str, layer: int, got: LayerPass, ref: LayerPass) -> Departure:
    """The worst departure of ``what`` over every head's columns (``got.head_positions``: each head's column
    positions, -1 where a column holds none), matched by position (a pressed layer's heads hold different ones)."""
    where = {p: j for j, p in enumerate(ref.positions)}
    worst = Departure(what, layer, None, 0.0, 0.0)
    g, r = getattr(got, what), getattr(ref, what)
    for h, cols in enumerate(got.head_positions):
        pairs = [(j, where[p], p) for j, p in enumerate(cols) if p >= 0 and p in where]
        d = kv_departure(what, layer, g[h:h + 1], r[h:h + 1], [a for a, _, _ in pairs], [b for _, b, _ in pairs],
                         [p for _, _, p in pairs])
        if d.relative > worst.relative or worst.position is None:
            worst = d
    return worst


def departures(got: Pass, ref: Pass, position: int) -> list[Departure]:
    """Every comparison of one step, in the model's order: per layer keys, values, state and output, then logits."""
    out = []
    for i, (g, r) in enumerate(zip(got.layers, ref.layers)):
        if g.keys is not None and r.keys is not None and g.head_positions is not None:
            out.append(head_departure("keys", i, g, r))
            if g.values is not None and r.values is not None:
                out.append(head_departure("values", i, g, r))
        elif g.keys is not None and r.keys is not None:
            gi, ri, pos = columns(g, r)
            out.append(kv_departure("keys", i, g.keys, r.keys, gi, ri, pos))
            if g.values is not None and r.values is not None:
                out.append(kv_departure("values", i, g.values, r.values, gi, ri, pos))
        if g.state is not None and r.state is not None:
            out.append(Departure("state", i, position, *_rel((g.state - r.state).abs(), r.state)))
        if g.out is not None and r.out is not None:
            out.append(Departure("output", i, position, *_rel((g.out - r.out).abs(), r.out)))
    out.append(Departure("logits", None, position, *_rel((got.logits - ref.logits).abs(), ref.logits)))
    return out


def first_departure(found: list[Departure], tolerance: float) -> Departure | None:
    """The first of ``found`` (one step's :func:`departures`, in the model's order) whose ``relative`` difference is
    beyond ``tolerance`` (the rule of :mod:`kvexplore.trace.parting`); None when the step departs nowhere."""
    return first_parting(((d, None, d.relative) for d in found), tolerance)
