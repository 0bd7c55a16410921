"""``check(exercise, answer)``: a number against the reference answer (within the exercise's tolerance), or a class run
through the doctor; a wrong number gets the hint of the mistake it looks like, never the answer."""

from __future__ import annotations

from ..errors import SettingsError
from .catalogue import exercise as find
from .numbers import number, same
from .verdict import Verdict


def check(exercise: str, answer=None, explorer=None) -> Verdict:
    """Check ``answer`` to ``exercise`` (``"02.1"``): a number for a compute exercise, your class for a code one, your
    prediction for a predict-then-see one (with ``explorer``, opened by ``course.explorer(exercise)`` and stepped).
    ``None``: not answered yet (what a notebook's exercise cell gives before you fill it in)."""
    from . import solutions

    ex = find(exercise)
    if ex.answer_is == "predict":
        from .predict import check_prediction

        return check_prediction(ex.id, answer, explorer)
    if explorer is not None:
        raise SettingsError(f"{ex.id} is not a predict-then-see exercise: check it without an explorer, "
                            f"course.check({ex.id!r}, answer)")
    if answer is None or answer is ...:
        return Verdict(ex.id, False, f"{ex.question} Put your answer in place of None and run the cell again.",
                       answered=False)
    if ex.answer_is == "layer":
        from .code_check import check_code  # every code exercise: its solutions module's CODE[id] says how
        return check_code(ex.id, answer)
    number(ex, answer)
    right = solutions.answer(ex.id)
    if same(answer, right, ex.tolerance):
        return Verdict(ex.id, True, f"{answer:,} {ex.unit}".strip() + " is right.")
    for value, hint in solutions.mistakes(ex.id):
        if same(answer, value, ex.tolerance):
            return Verdict(ex.id, False, f"{answer:,} {ex.unit}".strip() + f" is not it. Hint: {hint}")
    return Verdict(ex.id, False, f"{answer:,} {ex.unit}".strip() + f" is not it. Hint: {solutions.general_hint(ex.id)}")
