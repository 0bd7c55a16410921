"""The teacher's copy of the course: every notebook with each exercise followed by its solution (``kvexplore course
solutions DIR``). The students' notebooks show no solution; this copy is made from them and from
:mod:`kvexplore.course.solutions` when asked, so it never drifts from either."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

from .catalogue import exercise as find
from .exercise import Exercise

ASKS = re.compile(r'course\.check\("(\d\d\.\d+)"')  # the cell that checks an exercise
BANNER = ("**Teacher's copy** (written by `kvexplore course solutions`): every exercise is followed by its solution, "
          "and each solution's check says right. The students' notebooks (`kvexplore lab`) show none.")


def solution_cells(ex: Exercise) -> list[dict]:
    """The markdown and code cells of one exercise's solution."""
    from . import solutions

    hint = solutions.general_hint(ex.id) if ex.id in solutions.module(ex.id).HINTS else ""
    if ex.answer_is == "number":
        right = solutions.answer(ex.id)
        head = f"how: {hint}"
        source = f'from kvexplore import course\n\nanswer = {right!r}  # {ex.id}\ncourse.check("{ex.id}", answer)'
    elif ex.answer_is == "layer":
        head = (f"the reference class, from kvexplore/course/solutions/n{ex.notebook}.py, run through the same check; "
                f"the typical wrong ones the suite plants are listed there, in WRONG")
        source = (f'import inspect\n\nfrom kvexplore import course\nfrom kvexplore.course import solutions\n\n'
                  f'print(inspect.getsource(solutions.reference("{ex.id}")))\n'
                  f'course.check("{ex.id}", solutions.reference("{ex.id}"))')
    else:
        from .predict import moment_of

        moment = moment_of(ex.id)
        prediction = moment.predict(moment.build())  # the moment is the same every time: greedy on the tiny model
        head = f"worked out before the Step: {hint} Seen in {moment.where}."
        source = (f'prediction = {prediction!r}  # {ex.id}, before the Step\nex.step()  # or press Step\n'
                  f'course.check("{ex.id}", prediction, ex)')
    return [_cell("markdown", f"**Solution {ex.id}** ({head})"), _cell("code", source)]


def with_solutions(notebook: dict, number: str) -> tuple[dict, list[str]]:
    """A copy of notebook ``number`` (``"02"``, nbformat JSON) with the banner first and each of its exercises'
    solution after the cell that checks it (another notebook's exercise, shown as an example, is left alone); the
    exercises solved, in order."""
    cells, solved = [_cell("markdown", BANNER)], []
    for cell in notebook["cells"]:
        cells.append(cell)
        found = ASKS.search("".join(cell["source"])) if cell["cell_type"] == "code" else None
        if found and found.group(1).split(".")[0] == number:
            cells += solution_cells(find(found.group(1)))
            solved.append(found.group(1))
    return {**notebook, "cells": cells}, solved


def write_solutions(notebooks: Path, target: Path) -> dict[str, list[str]]:
    """Write the teacher's copy of every notebook of ``notebooks`` with an exercise into ``target`` (overwriting
    earlier copies: they are generated); notebook name -> the exercises it solves."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    written = {}
    for path in sorted(p for p in Path(notebooks).iterdir() if p.name.endswith(".ipynb")):
        copy, solved = with_solutions(json.loads(path.read_text(encoding="utf-8")), path.name[:2])
        if solved:
            (target / path.name).write_text(json.dumps(copy, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            written[path.name] = solved
    return written


def _cell(cell_type: str, text: str) -> dict:
    cell = {"cell_type": cell_type, "id": uuid.uuid4().hex[:8], "metadata": {}, "source": text.splitlines(True)}
    return {**cell, "execution_count": None, "outputs": []} if cell_type == "code" else cell
