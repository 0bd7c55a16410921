"""Where a lane first parts from the reference lane: the first step at which its own choice is not the reference's,
or its next-token distribution is further from the reference's than float32 rounding (KL above :data:`KL_PARTS`,
infinite where it rules the reference's token out). The cache map marks the position whose pass gave that step (in
every layer that holds it) and the token strip the token, so a zoo bug's lane beside its fixed twin shows where the
bug first shows."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..trace.parting import first_parting
from ..trace.records import StepRecord

KL_PARTS = 1e-5  # nats: two exact caches of one model differ by about 1e-9 (float32 summation order)


def first_divergence(history: Sequence[StepRecord], kl: Sequence[float | None],
                     top1: Sequence[bool | None]) -> tuple[int, int] | None:
    """``(step, position)`` of the first compared step where the lane parts from the reference (the position of the
    pass that chose the step's token: the token before it); None while it has not (or is the reference, or ran free
    of it)."""
    compared = ((record, same, math.inf if k is None else k)  # KL None: infinite (a token the lane rules out)
                for record, k, same in zip(history, kl, top1)
                if not (same is None and k is None))  # not compared: the reference, or a step a drafting lane chose
    record = first_parting(compared, KL_PARTS)
    return None if record is None else (record.step, record.position - 1)


DRIFT = "first drift"  # how a drift's mark begins (the token strip colours it apart)
DRIFT_COLOUR, CHANGE_COLOUR = "#b36b00", "#b30000"  # amber: the same token, a distribution apart; red: another token


def drift_only(top1: Sequence[bool | None], history: Sequence[StepRecord], step: int) -> bool:
    """Whether the lane's own choice at ``step`` was still the reference's (it parted by its distribution only)."""
    return next((same is True for record, same in zip(history, top1) if record.step == step), False)


def words(step: int, position: int, reference: str, drift: bool = False) -> str:
    """The mark's text: a changed token, or (``drift``) the same token from a distribution further from the
    reference's than float32 rounding."""
    if drift:
        return (f"{DRIFT} from {reference}: step {step} (the pass at position {position}) chose the same token, "
                f"from a distribution further than float rounding from it (KL above {KL_PARTS:g} nats)")
    return f"first divergence from {reference}: step {step} (the pass at position {position}): another token"


def headline(step: int, position: int, reference: str, drift: bool = False) -> str:
    """:func:`words` in one short line, for a figure's title (the hover and the token strip say it in full)."""
    return (f"{DRIFT} from {reference} at step {step}: same token, KL > {KL_PARTS:g}" if drift else
            f"first divergence from {reference} at step {step}: another token")
