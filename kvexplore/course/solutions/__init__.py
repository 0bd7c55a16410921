"""The course's exercises with their reference answers and solutions, apart from the notebooks (a teacher's, not a
student's), one module per notebook (``nNN.py``) declaring ``EXERCISES`` and per exercise: ``ANSWERS`` (worked out with
kvexplore itself, so that it follows the code), ``MISTAKES`` (the number a mistake gives and the hint it gets),
``HINTS`` (how to work it out), and for a code exercise ``REFERENCE`` and ``WRONG`` (typical wrong solutions with words
their verdict must contain). The suite runs them all."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def modules() -> list[ModuleType]:
    """The notebooks' modules (``n02``, ``n05``, ...), in the course's order."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name[0] == "n" and m.name[1:].isdigit())
    return [importlib.import_module(f"{__name__}.{name}") for name in names]


def module(exercise: str) -> ModuleType:
    """The module of the notebook ``exercise`` belongs to."""
    return importlib.import_module(f"{__name__}.n{exercise.split('.')[0]}")


def answer(exercise: str) -> float:
    return module(exercise).ANSWERS[exercise]()


def mistakes(exercise: str) -> list[tuple[float, str]]:
    """(the number a mistake gives, the hint that names the mistake) for each known mistake."""
    return [(make(), hint) for make, hint in module(exercise).MISTAKES.get(exercise, ())]


def general_hint(exercise: str) -> str:
    return module(exercise).HINTS[exercise]


def reference(exercise: str) -> type:
    """The reference solution of a code exercise."""
    return module(exercise).REFERENCE[exercise]


def wrong(exercise: str) -> list[tuple[type, str]]:
    """Typical wrong solutions of a code exercise, each with words its verdict must contain."""
    return module(exercise).WRONG[exercise]

