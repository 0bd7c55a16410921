"""What a departure probably means, in plain words: the cache's keys compared with the recomputation's, turned by
RoPE, shifted by a slot, swapped with the values; the columns attention read against those it should have."""

from __future__ import annotations

import torch

from .compare import Departure, columns
from .passes import LayerPass, Pass


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-6)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (transformers' rotate_half layout) on the first ``cos.shape[-1]`` channels of ``x`` (..., dim)."""
    n = cos.shape[-1]
    head, tail = x[..., :n], x[..., n:]
    a, b = head[..., : n // 2], head[..., n // 2:]
    turned = head * cos + torch.cat((-b, a), dim=-1) * sin
    return torch.cat((turned, tail), dim=-1)


def bad_positions(g: LayerPass, r: LayerPass, which: str, tol: float) -> list[tuple[int, int, int]]:
    """(got column, ref column, position) of every position whose keys/values depart beyond ``tol``."""
    gi, ri, pos = columns(g, r)
    got, ref = getattr(g, which), getattr(r, which)
    return [(a, b, p) for a, b, p in zip(gi, ri, pos) if not _close(got[:, a], ref[:, b], tol)]


def rope_offset(passes, layer: int, got: torch.Tensor, ref: torch.Tensor, position: int, tol: float,
                extra: tuple[int, ...] = ()) -> int | None:
    """The number of positions by which ``got`` (heads, dim) is ``ref`` turned by RoPE (None: not a turn); tries
    small offsets, ``-position`` (not rotated at all), ``position`` (rotated twice) and ``extra``."""
    if not hasattr(passes, "rotation"):
        return None
    offsets = sorted({-position, position, *range(-4, 5), *extra} - {0})
    turns = passes.rotation(layer, offsets)
    if turns is None:
        return None
    cos, sin = turns
    if cos.shape[-1] > got.shape[-1]:
        return None
    for d, c, s in zip(offsets, cos, sin):
        if _close(_turn(ref, c, s), got, tol):
            return d
    return None


def hint(first: Departure, got: Pass, ref: Pass, passes, prompt_len: int, position: int, tol: float) -> str:
    """A sentence for the first departure of a step."""
    near = max(10 * tol, 1e-3)  # "the same tensor" under another name: far tighter than any two unrelated ones
    if first.layer is None:
        return ("every layer's keys, values and output agree with the recomputation but the logits do not: the final "
                "norm or the output head is computed differently in a cached pass")
    own = getattr(passes, "explain", None)  # a reference of its own (a pressed cache's) may know better
    if own is not None and (said := own(first, got, ref, near)):
        return said
    L = first.layer
    g, r = got.layers[L], ref.layers[L]
    if g.head_positions is not None and first.what in ("keys", "values"):  # a pressed layer, compared head by head
        return (f"layer {L}'s {first.what} at position {first.position} differ from a recomputation with the same "
                f"kept set (by up to {first.max_diff:.3g}): the press stored, moved or turned them wrongly")
    if first.what == "state":
        return (f"layer {L}'s recurrent state departs from the recomputation's: the state was not carried from the "
                f"previous step (reset, stale, or updated twice)")
    if first.what in ("keys", "values"):
        bad = bad_positions(g, r, first.what, near)
        if first.what == "values" and bad and all(_close(g.values[:, a], r.keys[:, b], near) for a, b, _ in bad):
            return (f"layer {L} stores keys where the values go: its values at position{_span([p for *_, p in bad])} "
                    f"equal the keys there")
        if not bad:
            return (f"layer {L}'s {first.what} differ from the recomputation by {first.max_diff:.3g} at position "
                    f"{first.position}: small everywhere (precision lost in storage, e.g. a lower-precision cache)")
        positions = [p for _, _, p in bad]
        span = _span(positions)
        got_t, ref_t = getattr(g, first.what), getattr(r, first.what)
        gcols = {p: a for a, _, p in bad}
        refcol = {p: j for j, p in enumerate(r.positions)}
        p0 = positions[0]
        if all(float(got_t[:, gcols[p]].abs().max()) == 0.0 for p in positions):
            return (f"layer {L} read slots that hold nothing this sequence wrote (zeros) for position{span}: a stale "
                    f"or skipped slot was read")
        for shift in (-1, 1):
            if all(p + shift in refcol and _close(got_t[:, gcols[p]], ref_t[:, refcol[p + shift]], near)
                   for p in positions):
                return (f"layer {L}'s slot for position{span} holds position {p0 + shift}'s {first.what}: writes land "
                        f"one slot off (a stale slot is read in their place)")
        if first.what == "keys":
            offsets = {p: rope_offset(passes, L, got_t[:, gcols[p]], ref_t[:, refcol[p]], p, near) for p in positions}
            if all(d is not None for d in offsets.values()):
                if all(d == -p for p, d in offsets.items()):
                    if min(positions) < prompt_len:
                        return (f"keys stored before RoPE: layer {L}'s key at position{span} is the unrotated key "
                                f"(turning it by its position gives the recomputation's)")
                    return (f"a missing RoPE offset: layer {L}'s new key at position{span} was rotated as if at "
                            f"position 0; a cached step's position ids must start at the cache length")
                if all(d == p for p, d in offsets.items()) and len(positions) > 1:
                    return (f"RoPE applied twice: layer {L}'s key at position{span} is the recomputation's turned "
                            f"again by its own position (rotated for twice its position): the keys were rotated "
                            f"before the write and again when stored or read")
                ds = set(offsets.values())
                if len(ds) == 1:
                    d = ds.pop()
                    what = "a position off by one" if abs(d) == 1 else f"RoPE at the wrong position (off by {d})"
                    return (f"{what}: layer {L}'s key at position{span} was rotated for position {p0 + d}; the "
                            f"positions a cached step uses (the cache's length, cache_position) are off by {d:+d}")
        if len(bad) == len(columns(g, r)[2]) and first.relative < 0.25:
            return (f"every position's {first.what} in layer {L} differ a little (up to {first.relative:.2g} of their "
                    f"largest value): the cache keeps them in lower precision than the model computes (quantized?)")
        return (f"layer {L}'s {first.what} at position{span} differ from the recomputation's (by up to "
                f"{first.max_diff:.3g}): the cache holds something other than what the model computed there")
    # the keys and values agree where both hold them: what did attention read?
    return _reads_hint(L, g, r, position)


def _reads_hint(L: int, g: LayerPass, r: LayerPass, position: int) -> str:
    want = set(range(max(0, position + 1 - g.window) if g.window else 0, position + 1))
    read = set(g.positions)
    if g.keys is None:
        return f"layer {L}'s output departs from the recomputation's (it has no keys to compare: a state layer?)"
    extra, missing = sorted(read - want), sorted(want - read)
    if extra:
        return (f"stale slots read: layer {L}'s attention read {len(read)} positions where the sequence gives "
                f"{len(want)}, including position{_span(extra)}")
    if missing:
        if g.window:
            return (f"a window applied twice (or too short): layer {L} slides over {g.window} positions but read only "
                    f"{len(read)}; position{_span(missing)} {'was' if len(missing) == 1 else 'were'} dropped")
        return f"layer {L} did not read position{_span(missing)}: the cache dropped them"
    return (f"layer {L} read the right keys and values, yet its output departs: a mask over the wrong positions, or "
            f"attention computed differently in the cached pass")


def _span(positions: list[int]) -> str:
    ps = sorted(positions)
    if len(ps) == 1:
        return f" {ps[0]}"
    if ps == list(range(ps[0], ps[-1] + 1)):
        return f"s {ps[0]}..{ps[-1]}"
    return f"s {', '.join(map(str, ps[:6]))}{' …' if len(ps) > 6 else ''}"
