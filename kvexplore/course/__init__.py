"""Exercises a student does, checked by kvexplore itself: ``check("02.1", answer)`` says right, or wrong with a hint
that does not give the answer away; a code exercise's class is run through the doctor on the tiny model against a
recomputation without a cache (docs/teaching.md). The reference answers and solutions live in
:mod:`kvexplore.course.solutions`, apart from the notebooks."""

from __future__ import annotations

from .catalogue import EXERCISES, exercises
from .check import Verdict, check
from .exercise import Exercise

__all__ = ["EXERCISES", "Exercise", "Verdict", "check", "exercises"]
