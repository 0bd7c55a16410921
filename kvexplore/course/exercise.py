"""One exercise: what it asks, what it takes (a number or a layer class), where it is in the course, and how close a
number must be. Each notebook's are declared with their answers and reference solutions in its module of
:mod:`kvexplore.course.solutions` (``nNN.py``), apart from the notebooks; :mod:`kvexplore.course.catalogue` lists
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import SettingsError

ANSWERS = ("number", "layer", "predict")  # compute: a number; code: a layer class; predict: a number, then a Step


@dataclass(frozen=True)
class Exercise:
    id: str            # "02.1": the notebook's number, then the exercise's
    answer_is: str     # "number" (compute), "layer" (code: a class run through the doctor) or "predict" (a number
    #                    compared with what the explorer shows after a Step: kvexplore.course.predict)
    question: str      # in one or two sentences, as the notebook asks it
    tolerance: float = 0.0  # number or predict: the largest relative difference still right (0: exact)
    unit: str = ""     # number or predict: what the number counts ("bytes", "pages", "tokens")

    def __post_init__(self) -> None:
        if self.answer_is not in ANSWERS:
            raise SettingsError(f"exercise {self.id}: answer_is must be one of {ANSWERS}, got {self.answer_is!r}")

    @property
    def notebook(self) -> str:
        return self.id.split(".")[0]


@dataclass(frozen=True)
class Moment:
    """A predict-then-see exercise's moment (:mod:`kvexplore.course.predict`): the explorer it opens, what is read
    from it after the Step, and the reference prediction the suite checks against what it then shows."""

    build: Callable[[], Any]          # () -> the Explorer at the moment the question is asked
    see: Callable[[Any], int]         # the explorer after the step -> what it shows (the number asked for)
    predict: Callable[[Any], int]     # the explorer at the moment -> the reference prediction, worked out before
    where: str                        # where on the screen the answer is seen ("the cache map's shared slots")
    steps: int = 1                    # how many Steps the question is about
