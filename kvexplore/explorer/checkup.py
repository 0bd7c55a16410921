"""The cache doctor's check on a lane's cache as it stands: after a speculative verification took positions back, is
the cache what a cache that never saw the rejected drafts gives?

One doctor step (:mod:`kvexplore.diagnosis`) on a copy of the lane's cache (``cache.fork()``: the lane is not
touched), compared with a full recomputation of the sequence and, where the strategy departs from that by design,
with the same strategy prefilled again with the kept tokens (docs/explorer.md, "A speculative lane").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..diagnosis.compare import departures, first_departure
from ..diagnosis.passes import KVPasses
from ..diagnosis.take_back import check_cache

AUTO_TOKENS = 256  # up to this many tokens the session runs the check after each take-back; beyond, on demand


@dataclass(frozen=True)
class Checkup:
    """The doctor's verdict on a lane's cache after verification ``verification`` (at ``tokens`` tokens)."""

    verification: int
    tokens: int
    clean: bool
    text: str  # the verdict in words
    short: str  # the verdict in a few words (a line of a figure's title)
    worst: float  # the largest relative difference seen (the first departure's, when not clean)
    seconds: float


def check(model: Any, generator: Any, verification: int) -> Checkup:
    """Run one doctor step on a copy of ``generator``'s cache (see the module's docstring)."""
    t0 = time.perf_counter()
    tokens = list(generator.tokens)
    found = check_cache(model, generator.cache, tokens, len(generator.prompt_tokens))
    first, tol, got, start, position = found.first, found.tolerance, found.got, found.start, found.position
    if first is None:
        worst = found.worst
        text = (f"doctor: clean — the cache after the take-back reads what a recomputation of the {len(tokens)} "
                f"tokens gives (worst {worst.relative:.2g} relative, in the {worst.what}; tolerance {tol:g})")
        return Checkup(verification, len(tokens), True, text, f"doctor: clean (worst {worst.relative:.1g} relative)",
                       worst.relative, time.perf_counter() - t0)
    layer = "the logits" if first.layer is None else f"layer {first.layer}"
    text = (f"{layer}: {first.what} differ by {first.max_diff:.3g} at position {first.position} (tolerance {tol:g}) "
            f"— {found.hint}")
    # a strategy that departs from recomputation by design (a sink window, quantization): is the cache at least
    # the one that never saw the drafts? The same strategy prefilled again with the kept tokens says
    again = generator.cache.fork()
    again.truncate(0)
    with torch.inference_mode():
        generator.executor.replay(tokens[:start], again)
        twin = KVPasses(model, again).cached(tokens[start:], start)
    same = first_departure(departures(got, twin, position), tol)
    if same is None:
        text = (f"doctor: the take-back is exact — the cache reads what the same strategy prefilled again with the "
                f"kept tokens reads; against a full recomputation it departs as the strategy does ({text})")
        return Checkup(verification, len(tokens), True, text, "doctor: exact (equals the strategy prefilled "
                       "again)", first.relative, time.perf_counter() - t0)
    return Checkup(verification, len(tokens), False, "doctor: departs at " + text,
                   f"doctor: DEPARTS at {layer} ({first.what}, position {first.position})", first.relative,
                   time.perf_counter() - t0)


def safely(model: Any, generator: Any, verification: int) -> Checkup:
    """:func:`check`, its failure kept as a verdict (the step it follows has succeeded: it stays)."""
    try:
        return check(model, generator, verification)
    except Exception as e:  # noqa: BLE001 (any failure of the check is its finding, shown, not raised)
        return Checkup(verification, len(generator.tokens), False, f"doctor: could not run ({type(e).__name__}: {e})",
                       "doctor: could not run (details)", float("nan"), 0.0)
