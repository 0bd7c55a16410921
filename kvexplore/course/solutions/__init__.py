"""The course's reference answers and solutions, apart from the notebooks (a teacher's, not a student's): per
exercise its answer (worked out with kvexplore itself, so that it follows the code), the mistakes students make with
the hint each gets, the reference solution of a code exercise and typical wrong ones (the suite runs them all)."""

from __future__ import annotations

from collections.abc import Callable

from . import n02, n05, n13

_MODULES = {"02": n02, "05": n05, "13": n13}


def _module(exercise: str):
    return _MODULES[exercise.split(".")[0]]


def answer(exercise: str) -> float:
    return _module(exercise).ANSWERS[exercise]()


def mistakes(exercise: str) -> list[tuple[float, str]]:
    """(the number a mistake gives, the hint that names the mistake) for each known mistake."""
    return [(make(), hint) for make, hint in _module(exercise).MISTAKES.get(exercise, ())]


def general_hint(exercise: str) -> str:
    return _module(exercise).HINTS[exercise]


def reference(exercise: str) -> type:
    """The reference solution of a code exercise."""
    return _module(exercise).REFERENCE[exercise]


def wrong(exercise: str) -> list[tuple[type, str]]:
    """Typical wrong solutions of a code exercise, each with words its verdict must contain."""
    return _module(exercise).WRONG[exercise]


Mistake = tuple[Callable[[], float], str]
