"""What the cache doctor found: the first step and layer where cached decoding departs from recomputation."""

from __future__ import annotations

from dataclasses import dataclass, field

from .compare import Departure


@dataclass
class DoctorReport:
    """``diverged``; ``step`` (numbered as :attr:`~kvexplore.StepRecord.step`: 0 is the token chosen after
    prefill), ``layer`` (None when only the logits depart), ``position`` and ``max_diff`` of the first departure
    beyond ``tolerance``, ``what`` departed (keys, values, state, output, logits) and a plain-words ``hint``.
    A clean run has ``diverged=False`` and ``worst``, the largest difference seen in ``steps`` steps."""

    diverged: bool
    steps: int  # steps compared
    tolerance: float
    cache: str
    model: str
    dtype: str
    step: int | None = None
    layer: int | None = None
    position: int | None = None
    max_diff: float | None = None
    what: str | None = None
    hint: str = ""
    worst: Departure | None = None
    tokens: list[int] = field(default_factory=list)  # the sequence compared (prompt and chosen tokens)
    departures: list[Departure] = field(default_factory=list)  # every comparison of the step reported
    reference: str = "a full recomputation"  # what the cached passes were compared with
    lossy: str = ""  # a lossy-by-design cache: what it did (checked against its scheme at ``step``, then stopped)
    scheme_error: float | None = None  # there, the largest difference of the keys read from the recomputation's
    scheme_bound: float | None = None  # and the most the scheme allows (half a quantization step), absolute

    def summary(self) -> str:
        where = f"{self.model} · cache {self.cache} · {self.dtype}"
        if self.lossy and not self.diverged:
            return (f"lossy by design ({self.lossy}): exact for the {self.step} steps before it first lost precision; "
                    f"at step {self.step} the keys attention read differ from {self.reference}'s by up to "
                    f"{self.scheme_error:.3g}, inside the scheme's bound at every element (half a quantization step, "
                    f"up to {self.scheme_bound:.3g}; tolerance {self.tolerance:g} beyond it); past it the outputs "
                    f"part from {self.reference} by design, so the check stops ({where})")
        if not self.diverged:
            w = self.worst
            worst = "" if w is None else (f"; worst difference {w.relative:.2g} (relative) in the {w.what}"
                                          f"{'' if w.layer is None else f' of layer {w.layer}'}")
            return (f"no divergence in {self.steps} steps: cached decoding matches {self.reference} within "
                    f"{self.tolerance:g} ({where}){worst}")
        layer = "the logits" if self.layer is None else f"layer {self.layer}"
        return (f"first divergence at step {self.step}, {layer}: {self.what} differ by {self.max_diff:.3g} at position "
                f"{self.position} (tolerance {self.tolerance:g}; {where})\n  hint: {self.hint}")

    __str__ = summary
