"""Every exercise of the course, collected from the notebooks' modules of :mod:`kvexplore.course.solutions`."""

from __future__ import annotations

from ..errors import SettingsError
from .exercise import Exercise
from .solutions import modules


def _collect() -> dict[str, Exercise]:
    """Every notebook's exercises, as its module of :mod:`kvexplore.course.solutions` declares them, in order."""
    found: dict[str, Exercise] = {}
    for module in modules():
        for e in module.EXERCISES:
            if e.id in found:
                raise SettingsError(f"exercise {e.id} is declared twice ({module.__name__})")
            found[e.id] = e
    return dict(sorted(found.items(), key=lambda kv: tuple(int(x) for x in kv[0].split("."))))


EXERCISES: dict[str, Exercise] = _collect()


def exercises(notebook: str | None = None) -> list[Exercise]:
    """Every exercise, or a notebook's (``"02"``)."""
    return [e for e in EXERCISES.values() if notebook is None or e.notebook == notebook]


def exercise(id: str) -> Exercise:
    if id not in EXERCISES:
        raise SettingsError(f"no exercise {id!r}; the exercises are {', '.join(EXERCISES)} "
                            f"(kvexplore.course.exercises() lists them with their questions)")
    return EXERCISES[id]
