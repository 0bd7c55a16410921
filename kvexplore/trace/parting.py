"""Where two runs part: the one rule every comparison of two runs of the same prompt uses.

Two runs are walked side by side, step by step (or layer by layer, or token by token). At each compared place the
caller says whether both chose the same token (``same``: None where tokens are not compared there) and how far
apart what they computed is (``gap``: a logit difference, a KL divergence, a relative difference of keys; None
where it is not measured). The runs part at the first place whose tokens differ or whose gap is beyond the
tolerance (strictly: a gap equal to the tolerance, or NaN, does not part).

Its callers: :func:`kvexplore.diff_traces` (recorded keys, values, attention), the cache doctor
(:func:`kvexplore.diagnosis.compare.first_departure`: a cached pass against the recomputation), the bug zoo
(:func:`kvexplore.bugs.runs.first_divergence`: a planted run against its fixed twin) and the explorer
(:func:`kvexplore.views.divergence.first_divergence`: a lane against the reference, by :func:`kl_divergence`).
"""

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
