"""``kvexplore course``: the course's exercises per notebook, and the teacher's copy of the notebooks with every
solution (docs/teaching.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

KINDS = {"number": "compute", "layer": "code", "predict": "predict, then see"}


def add_parser(sub: argparse._SubParsersAction, parser_class: type) -> None:
    course = sub.add_parser("course", help="the course's exercises, and the teacher's copy of the notebooks with "
                                           "their solutions")
    verbs = course.add_subparsers(dest="verb", required=True, parser_class=parser_class)
    verbs.add_parser("list", help="every exercise, notebook by notebook: its kind and question")
    solutions = verbs.add_parser("solutions", help="write the teacher's copy of every notebook with exercises: each "
                                                   "exercise followed by its solution (overwrites earlier copies)")
    solutions.add_argument("--dir", default=None, metavar="DIR",
                           help="where to write them (default: ~/kvexplore-solutions); never your notebooks' folder")


def run(args: argparse.Namespace) -> int:
    from ..course import exercises

    if args.verb == "list":
        notebook = None
        for e in exercises():
            if e.notebook != notebook:
                notebook = e.notebook
                print(f"\nnotebook {notebook}")
            print(f"  {e.id} ({KINDS[e.answer_is]}) {e.question}")
        print(f"\n{len(exercises())} exercises; check one with kvexplore.course.check(id, answer)")
        return 0
    from ..course.teacher import write_solutions
    from .launch import notebooks_root

    target = Path(args.dir).expanduser() if args.dir else Path.home() / "kvexplore-solutions"
    source = Path(str(notebooks_root()))
    if target.resolve() == source.resolve():
        raise ValueError(f"{target} holds the students' notebooks: write the teacher's copy somewhere else (--dir)")
    written = write_solutions(source, target)
    for name, solved in written.items():
        print(f"  {name}: {', '.join(solved)}")
    print(f"{sum(map(len, written.values()))} solutions in {len(written)} notebooks written to {target}")
    return 0
