"""How a number a student gives is judged: refused unless it is a finite number, and equal to another within the
exercise's tolerance (relative; 0: exactly)."""

from __future__ import annotations

import math
from numbers import Real

from ..errors import SettingsError


def number(ex, answer) -> None:
    """Refuse an answer that is not a finite number (a string, a bool, NaN), naming what the exercise counts."""
    if isinstance(answer, bool) or not isinstance(answer, Real) or not math.isfinite(answer):
        raise SettingsError(f"{ex.id} asks for a number ({ex.unit or 'a count'}), got {answer!r}")


def same(a: float, b: float, tolerance: float) -> bool:
    return a == b if tolerance == 0 else abs(a - b) <= tolerance * max(abs(b), 1e-12)
