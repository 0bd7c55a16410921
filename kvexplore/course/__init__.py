"""Exercises a student does, checked by kvexplore itself: ``check("02.1", answer)`` says right, or wrong with a hint
that does not give the answer away; a code exercise's class is run through the doctor on the tiny model against a
recomputation without a cache; a predict-then-see exercise opens an explorer (``course.explorer("05.3")``), and
after one Step ``check("05.3", prediction, ex)`` compares the prediction with what it shows (docs/teaching.md).
The reference answers and solutions live in :mod:`kvexplore.course.solutions`, apart from the notebooks."""

from __future__ import annotations

from .catalogue import EXERCISES, exercises
from .check import Verdict, check
from .exercise import Exercise
from .predict import explorer

__all__ = ["EXERCISES", "Exercise", "Verdict", "check", "exercises", "explorer"]
