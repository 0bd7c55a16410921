"""Run a catalogued bug with the bug planted and without, and say where and why the two part."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..errors import SettingsError
from .catalog import Bug, get
from .models import WINDOW, windowed, zoo_model
from .runs import Divergence, Run, first_divergence


@dataclass
class Reproduction:
    """``bug`` run twice on ``model``: ``broken`` (the bug planted) and ``fixed`` (kvexplore's own code);
    ``first_divergence`` where they first part (None if they never do); ``doctor``, the bug's checker on the broken
    run, and ``fixed_doctor`` on the fixed one (clean when the twin is right); ``seconds`` for all four."""

    bug: Bug
    model: Any
    broken: Run
    fixed: Run
    first_divergence: Divergence | None
    doctor: Any
    fixed_doctor: Any
    seconds: float

    @property
    def caught(self) -> bool:
        """The checker flags the broken run and passes the fixed one."""
        return bool(self.doctor.diverged) and not self.fixed_doctor.diverged

    def explain(self) -> str:
        """The bug, where the runs part, and what the checker said, in words."""
        b, d = self.bug, self.first_divergence
        lines = [f"{b.name} ({b.area}; {b.engine}, {b.reference})", f"  what went wrong: {b.summary}",
                 f"  symptom: {b.symptom}", f"  the invariant: {b.invariant}"]
        if d is None:
            lines.append("  the broken and the fixed run did not part: this model and prompt do not show it")
        else:
            lines.append(f"  first divergence: {d}")
            lines.append(f"  the broken run's tokens from there: {_tail(self.broken, d)}; the fixed run's: "
                         f"{_tail(self.fixed, d)}")
        lines.append(f"  {b.checker} on the broken run: {_indent(self.doctor.summary())}")
        lines.append(f"  {b.checker} on the fixed twin: {_indent(self.fixed_doctor.summary())}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Reproduction({self.bug.name!r}, first_divergence={self.first_divergence}, "
                f"caught={self.caught}, {self.seconds:.1f} s)")


def _tail(run: Run, d: Divergence, n: int = 6) -> list[int]:
    unit = run.tokens[d.index] if d.index < len(run.tokens) else []
    if run.unit == "step":
        return run.chosen[d.index: d.index + n]
    return unit[d.offset: d.offset + n]


def _indent(text: str) -> str:
    return text.replace("\n", "\n    ")


def model_for(bug: Bug, model: Any = None) -> Any:
    """The model ``bug`` runs on: the zoo's default for it, or ``model`` (a name or a loaded model; a windowed bug on
    a model without sliding layers gets a windowed twin of it)."""
    if model is None:
        return zoo_model(bug.model)
    if isinstance(model, str):
        model = zoo_model(model)
    if not hasattr(model, "config") or not hasattr(model, "tokenizer"):
        raise SettingsError(f"model must be a kvexplore model or a model name (kvexplore.load), got "
                            f"{type(model).__name__}")
    if bug.model == "tiny-windowed" and "sliding_attention" not in model.config.layer_types:
        model = windowed(model, WINDOW)
    return model


def reproduce(name: str, model: Any = None) -> Reproduction:
    """Run bug ``name`` (see :func:`~kvexplore.bugs.catalog`) with the bug planted and without, on the tiny model
    (or ``model``), compare the runs and run the bug's checker on both."""
    bug = get(name)
    model = model_for(bug, model)
    t0 = time.perf_counter()
    fixed = bug.run(model, False)
    broken = bug.run(model, True)
    report = bug.check(model, True)
    clean = bug.check(model, False)
    return Reproduction(bug, model, broken, fixed, first_divergence(broken, fixed, report), report, clean,
                        time.perf_counter() - t0)
