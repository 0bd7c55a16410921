"""The teacher's copy of the course (``kvexplore course solutions``): every exercise of every notebook is followed by
its solution, and each solution cell, run as a notebook runs it, gets a right verdict; the students' notebooks are
left without one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvexplore import course
from kvexplore.cli.commands import main
from kvexplore.course.teacher import BANNER

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def _run(source: str, namespace: dict):
    """Run a code cell as a kernel does and give its last expression's value."""
    *body, last = source.rstrip().split("\n")
    exec("\n".join(body), namespace)
    return eval(last, namespace)


@pytest.mark.long  # every exercise's solution checked, code ones through the doctor (about 40 s)
def test_every_solution_in_the_teachers_copy_is_right(tmp_path, capsys):
    assert main(["course", "solutions", "--dir", str(tmp_path)]) == 0
    assert f"{len(course.exercises())} solutions in 12 notebooks written to {tmp_path}" in capsys.readouterr().out
    solved = []
    for path in sorted(tmp_path.glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        assert "".join(cells[0]["source"]) == BANNER
        student = json.loads((NOTEBOOKS / path.name).read_text())["cells"]
        assert [c for c in cells if c in student] == student  # every student cell, in order, unchanged
        namespace: dict = {}
        for i, cell in enumerate(cells):
            text = "".join(cell["source"])
            if cell["cell_type"] != "markdown" or not text.startswith("**Solution "):
                continue
            exercise = text.split()[1].rstrip("*")
            code = "".join(cells[i + 1]["source"])
            if "course.explorer(" in "".join(cells[i - 2]["source"]):  # predict: the explorer cell comes first
                _run("".join(cells[i - 2]["source"]), namespace)
            verdict = _run(code, namespace)
            assert verdict.exercise == exercise and verdict.ok, (exercise, verdict.message)
            solved.append(exercise)
    assert solved == list(course.EXERCISES)


def test_the_teachers_copy_is_never_written_over_the_students_notebooks(capsys):
    assert main(["course", "solutions", "--dir", str(NOTEBOOKS)]) == 1
    assert "holds the students' notebooks: write the teacher's copy somewhere else (--dir)" in capsys.readouterr().err


def test_course_list_names_every_exercise_with_its_kind(capsys):
    assert main(["course", "list"]) == 0
    out = capsys.readouterr().out
    assert "  02.2 (code) Write the pre-allocated layer's write" in out
    assert "  05.3 (predict, then see) The explorer prefilled a prompt on a paged cache" in out
    assert f"{len(course.exercises())} exercises;" in out
