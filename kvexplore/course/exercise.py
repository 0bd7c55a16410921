"""One exercise: what it asks, what it takes (a number or a layer class), where it is in the course, and how close a
number must be. Each notebook's are declared with their answers and reference solutions in its module of
:mod:`kvexplore.course.solutions` (``nNN.py``), apart from the notebooks; :mod:`kvexplore.course.catalogue` lists
them."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SettingsError

ANSWERS = ("number", "layer")  # a compute exercise takes a number, a code exercise a layer class


@dataclass(frozen=True)
class Exercise:
    id: str            # "02.1": the notebook's number, then the exercise's
    answer_is: str     # "number" (a compute exercise) or "layer" (code: a class run through the doctor)
    question: str      # in one or two sentences, as the notebook asks it
    tolerance: float = 0.0  # compute: the largest relative difference still right (0: exact)
    unit: str = ""     # compute: what the number counts ("bytes", "pages", "tokens")

    def __post_init__(self) -> None:
        if self.answer_is not in ANSWERS:
            raise SettingsError(f"exercise {self.id}: answer_is must be one of {ANSWERS}, got {self.answer_is!r}")

    @property
    def notebook(self) -> str:
        return self.id.split(".")[0]
