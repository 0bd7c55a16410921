"""Predict, then see: ``ex = course.explorer("05.3")`` opens an explorer at the moment a question is about; the
student writes what it will show after the next Step, presses Step, and ``course.check("05.3", prediction, ex)``
compares the prediction with what the explorer now holds (and, when it differs, says what it shows and why).

An exercise declares its moment in its notebook's module of :mod:`kvexplore.course.solutions`: ``MOMENTS[id]`` a
:class:`~kvexplore.course.exercise.Moment` (how to build the explorer, what to read from it after the step, and the
reference prediction worked out from the moment alone, which the suite checks against what the explorer then
shows)."""

from __future__ import annotations

import weakref

from ..errors import SettingsError
from .catalogue import exercise as find
from .exercise import Moment
from .numbers import number, same
from .verdict import Verdict


_opened: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # explorer -> (exercise, records at the moment)


def moment_of(exercise: str) -> Moment:
    from . import solutions

    return solutions.module(exercise).MOMENTS[exercise]


def _records(explorer) -> int:
    return len(explorer.session.reference.history)


def explorer(exercise: str):
    """The explorer at the moment exercise ``exercise`` asks about (a predict-then-see exercise): show it, write your
    prediction, press Step, then ``course.check(exercise, prediction, explorer)``."""
    ex = find(exercise)
    if ex.answer_is != "predict":
        raise SettingsError(f"{ex.id} is not a predict-then-see exercise (it takes {ex.answer_is}): "
                            f"answer it with course.check({ex.id!r}, answer)")
    shown = moment_of(ex.id).build()
    _opened[shown] = (ex.id, _records(shown))
    return shown


def check_prediction(exercise: str, prediction, shown) -> Verdict:
    from . import solutions

    ex = find(exercise)
    if shown is None:
        raise SettingsError(f"{ex.id} compares your prediction with the explorer after the Step: pass the explorer, "
                            f"course.check({ex.id!r}, prediction, ex), with ex = course.explorer({ex.id!r})")
    opened = _opened.get(shown) if _weakrefable(shown) else None
    if opened is None or opened[0] != ex.id:
        raise SettingsError(f"this explorer was not opened for {ex.id}: ex = course.explorer({ex.id!r}) opens it at "
                            f"the moment the question is about")
    if prediction is None or prediction is ...:
        return Verdict(ex.id, False, f"{ex.question} Write your prediction in place of None, then press Step once "
                                     f"(or run ex.step()) and run this cell again.", answered=False)
    number(ex, prediction)
    moment = moment_of(ex.id)
    taken = _records(shown) - opened[1]
    steps = "one Step" if moment.steps == 1 else f"{moment.steps} Steps"
    if taken == 0:
        return Verdict(ex.id, False, "your prediction is written: now press Step (or run ex.step()), then run this "
                                     "cell again.", answered=False)
    if taken != moment.steps:
        moved = f"is {_count(taken, 'Steps')} past it" if taken > 0 else "went back before it"
        return Verdict(ex.id, False, f"the question is about {steps} from the moment it was asked, and the explorer "
                                     f"{moved}: open it again with course.explorer({ex.id!r}), predict, then Step.",
                       answered=False)
    seen = moment.see(shown)
    shows = f"the explorer shows {_count(seen, ex.unit)} ({moment.where})"
    if same(prediction, seen, ex.tolerance):
        return Verdict(ex.id, True, f"{prediction:,} is right: {shows}.")
    for make, hint in solutions.module(ex.id).MISTAKES.get(ex.id, ()):
        if same(prediction, make(shown), ex.tolerance):
            return Verdict(ex.id, False, f"you predicted {prediction:,}; {shows}. Hint: {hint}")
    return Verdict(ex.id, False, f"you predicted {prediction:,}; {shows}. Hint: {solutions.general_hint(ex.id)}")


def _count(n: int, unit: str) -> str:
    """``3 pages``, ``1 page``, ``9`` (no unit)."""
    return f"{n:,} {unit[:-1] if n == 1 and unit.endswith('s') else unit}".rstrip()


def _weakrefable(obj) -> bool:
    try:
        weakref.ref(obj)
    except TypeError:
        return False
    return True
