"""The course's exercises: every reference answer and solution passes ``check``; every known mistake and every typical
wrong solution fails with the hint that names it, never the answer; bad input is refused with a message."""

from __future__ import annotations

import pytest

import kvexplore
from kvexplore import course
from kvexplore.course import solutions

NUMBERS = [e.id for e in course.exercises() if e.answer_is == "number"]
LAYERS = [e.id for e in course.exercises() if e.answer_is == "layer"]


@pytest.mark.parametrize("exercise", NUMBERS)
def test_the_reference_answer_is_right_and_each_mistake_gets_its_own_hint(exercise):
    right = solutions.answer(exercise)
    verdict = course.check(exercise, right)
    assert verdict.ok and verdict and f"{right:,}" in verdict.message
    hints = []
    for value, hint in solutions.mistakes(exercise):
        assert value != right, f"{exercise}: a mistake gives the right answer"
        wrong = course.check(exercise, value)
        assert not wrong.ok and wrong.message.endswith(f"Hint: {hint}")
        assert f"{right:,}" not in wrong.message  # the answer is never given away
        hints.append(hint)
    assert len(set(hints)) == len(hints)
    other = course.check(exercise, right * 3 + 7)
    assert not other.ok and solutions.general_hint(exercise) in other.message


def test_the_answers_follow_the_code_and_the_formulas():
    c = kvexplore.load("tiny").config
    assert solutions.answer("02.1") == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 256 * 4 == 786_432
    assert solutions.answer("05.1") == 4   # 3 pages of the prompt, and the shared last page copied once
    assert solutions.answer("13.1") == 32  # the block holding token 45 (block 2) and everything after it computed
    assert solutions.answer("03.1") == sum(range(8, 33)) == 500  # every pass feeds the whole sequence so far
    position = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4  # 3,072 bytes a position
    assert solutions.answer("04.1") == position * sum(range(8, 18)) == 384_000  # the previous cache, each step
    values = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 256
    assert solutions.answer("14.1") == values * 9 // 16 == 110_592  # q4_0: 4.5 bits a value


@pytest.mark.parametrize("exercise", LAYERS)
def test_the_reference_layer_passes_the_doctor_and_each_wrong_one_is_named(exercise):
    assert course.check(exercise, solutions.reference(exercise)).ok
    for cls, words in solutions.wrong(exercise):
        verdict = course.check(exercise, cls)
        assert not verdict.ok and words in verdict.message, (cls.__name__, verdict.message)


def test_an_unanswered_exercise_says_what_to_do_and_bad_input_is_refused():
    blank = course.check("02.1")
    assert not blank.ok and not blank.answered and "Put your answer in place of None" in blank.message
    assert "not answered yet" in blank._repr_html_()
    with pytest.raises(kvexplore.SettingsError, match=r"no exercise '99.9'; the exercises are 02.1, 02.2"):
        course.check("99.9", 1)
    with pytest.raises(kvexplore.SettingsError, match=r"02.1 asks for a number \(bytes\), got '786432'"):
        course.check("02.1", "786432")
    with pytest.raises(kvexplore.SettingsError, match="a subclass of PreallocatedLayer"):
        course.check("02.2", 42)


def test_every_exercise_is_asked_in_its_notebook():
    import json
    from pathlib import Path

    notebooks = Path(__file__).resolve().parents[2] / "notebooks"
    for e in course.exercises():
        (path,) = notebooks.glob(f"{e.notebook}_*.ipynb")
        text = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"])
        assert f'check("{e.id}"' in text, f"{path.name} does not ask exercise {e.id}"
