"""Where two runs part: the one rule every comparison of two runs of the same prompt uses. The runs part at the first
compared place whose tokens differ or whose gap is beyond the tolerance (strictly: a gap equal to it, or NaN, does
not part). Its callers: :func:`kvexplore.diff_traces`, the cache doctor, the bug zoo and the explorer."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

import torch

T = TypeVar("T")


def parts(same: bool | None, gap: float | None, tolerance: float) -> bool:
    """Whether one compared place parts: another token chosen (``same`` False), or ``gap`` above ``tolerance``."""
    return same is False or (gap is not None and gap > tolerance)


def first_parting(compared: Iterable[tuple[T, bool | None, float | None]], tolerance: float) -> T | None:
    """The ``where`` of the first ``(where, same, gap)`` that :func:`parts`; None when the runs never part.
    ``compared`` is read lazily and no further than that place (``where``: whatever the caller names a place by)."""
    return next((where for where, same, gap in compared if parts(same, gap, tolerance)), None)


def kl_divergence(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    """KL(p || q) in nats between two next-token distributions given as log-probabilities ``(vocab,)``: the gap the
    explorer measures a lane by against the reference (``p``). Infinite where ``q`` rules out a token ``p`` allows;
    ``0 log 0`` counts 0."""
    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros(()))
    return float(terms.sum().clamp_min(0))
