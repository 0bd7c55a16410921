"""Predict-then-see exercises: the reference prediction, worked out from the moment alone, equals what the explorer
shows after one Step; each known mistake gets its own hint; a check before the Step, after two Steps, or on another
explorer says what to do instead of judging."""

from __future__ import annotations

import pytest

import kvexplore
from kvexplore import course
from kvexplore.course import solutions
from kvexplore.course.predict import moment_of

PREDICT = [e.id for e in course.exercises() if e.answer_is == "predict"]


def test_the_course_has_a_predict_exercise_in_four_notebooks():
    assert PREDICT == ["02.3", "05.3", "06.3", "11.3"]


@pytest.mark.parametrize("exercise", PREDICT)
def test_the_reference_prediction_is_what_the_explorer_shows_after_the_step(exercise):
    moment = moment_of(exercise)
    ex = course.explorer(exercise)
    prediction = moment.predict(ex)
    before = course.check(exercise, prediction, ex)
    assert not before.ok and not before.answered and "now press Step" in before.message
    ex.step()
    verdict = course.check(exercise, prediction, ex)
    assert verdict.ok, verdict.message
    assert f"the explorer shows {moment.see(ex):,}" in verdict.message and moment.where in verdict.message
    hints = []
    for make, hint in solutions.module(exercise).MISTAKES[exercise]:
        value = make(ex)
        assert value != prediction, f"{exercise}: a mistake gives the right prediction"
        wrong = course.check(exercise, value, ex)
        assert not wrong.ok and wrong.answered and wrong.message.endswith(f"Hint: {hint}")
        assert wrong.message.startswith(f"you predicted {value:,}; the explorer shows {prediction:,}")
        hints.append(hint)
    assert len(set(hints)) == len(hints) >= 2
    other = course.check(exercise, prediction * 3 + 7, ex)
    assert not other.ok and solutions.general_hint(exercise) in other.message
    ex.step()  # one Step too many: not judged
    late = course.check(exercise, prediction, ex)
    assert not late.ok and not late.answered
    assert f"is 2 Steps past it: open it again with course.explorer('{exercise}')" in late.message


def test_the_answers_follow_what_the_caches_do():
    """The numbers behind the four moments, worked out independently of the exercises' own functions."""
    ex = course.explorer("05.3")
    cache = ex.lanes["paged"].cache
    length = cache.length
    assert length % 8 != 0  # the last page is partly filled: the next write lands in a shared page
    assert len(cache.block_tables[0]) == -(-length // 8) and all(cache.pool.refcount[p] == 2
                                                                  for p in cache.block_tables[0])
    ex.step()
    assert [cache.pool.refcount[p] for p in cache.block_tables[0]] == [2] * (length // 8) + [1]

    ex = course.explorer("06.3")
    held = sorted(p for p in ex.lanes["sink"].cache.inspect.slot_view(0).positions if p >= 0)
    ex.step()
    after = sorted(p for p in ex.lanes["sink"].cache.inspect.slot_view(0).positions if p >= 0)
    (gone,) = set(held) - set(after)
    assert held[:4] == [0, 1, 2, 3] == after[:4] and gone == held[4]
    assert course.check("06.3", gone, ex).ok


def test_a_prediction_needs_its_own_explorer_and_a_number():
    ex = course.explorer("02.3")
    blank = course.check("02.3", None, ex)
    assert not blank.ok and not blank.answered and "Write your prediction in place of None" in blank.message
    with pytest.raises(kvexplore.SettingsError, match=r"pass the explorer, course.check\('02.3', prediction, ex\)"):
        course.check("02.3", 9)
    with pytest.raises(kvexplore.SettingsError, match=r"not opened for 06.3: ex = course.explorer\('06.3'\)"):
        course.check("06.3", 9, ex)
    plain = kvexplore.Explorer("tiny", strategies=("preallocated",), max_seq_len=32)
    with pytest.raises(kvexplore.SettingsError, match="not opened for 02.3"):
        course.check("02.3", 9, plain)
    with pytest.raises(kvexplore.SettingsError, match=r"02.3 asks for a number"):
        course.check("02.3", "nine", ex)
    with pytest.raises(kvexplore.SettingsError, match=r"02.1 is not a predict-then-see exercise: check it without"):
        course.check("02.1", 786_432, ex)
    with pytest.raises(kvexplore.SettingsError, match=r"02.1 is not a predict-then-see exercise \(it takes number\)"):
        course.explorer("02.1")
    ex.rewind(1)
    back = course.check("02.3", 9, ex)
    assert not back.ok and "went back before it" in back.message
