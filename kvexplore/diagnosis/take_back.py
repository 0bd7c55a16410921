"""One doctor step on a cache as it stands (after a speculative verification took positions back): a copy of the cache
(``cache.fork()``: the original is not touched) is fed the tokens it does not hold yet, and what its attention read,
each layer's output, a recurrent state and the logits are compared with a full recomputation of the sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..trace.diff import tolerance_for
from .compare import Departure, departures, first_departure
from .hints import hint
from .passes import KVPasses, Pass


@dataclass
class StepCheck:
    """``first``: the first departure beyond ``tolerance`` (None: the cache is what a recomputation gives), ``worst``
    the largest seen, ``hint`` (why, in words, when it departs); ``got`` / ``ref`` the two passes, ``start`` the
    length of the cache checked, ``position`` the newest token's."""

    first: Departure | None
    worst: Departure
    hint: str
    tolerance: float
    got: Pass
    ref: Pass
    start: int
    position: int


def check_cache(model: Any, cache: Any, tokens: list[int], prompt_len: int) -> StepCheck:
    """The doctor's step on a fork of ``cache`` (holding the first ``cache.length`` of ``tokens``)."""
    twin = cache.fork()
    passes = KVPasses(model, twin)
    start = twin.length
    tol = tolerance_for(model.dtype)
    with torch.inference_mode():
        got = passes.cached(tokens[start:], start)
        ref = passes.reference(tokens)
    position = len(tokens) - 1
    found = departures(got, ref, position)
    first = first_departure(found, tol)
    worst = max(found, key=lambda d: d.relative)
    why = "" if first is None else hint(first, got, ref, passes, prompt_len, position, tol)
    return StepCheck(first, worst, why, tol, got, ref, start, position)
