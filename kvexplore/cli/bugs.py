"""``kvexplore bugs``: the zoo of cache bugs: list the catalogue, run one beside its fixed twin."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction, parser_class: type) -> None:
    bugs = sub.add_parser("bugs", help="a zoo of real cache bugs, each planted in kvexplore's own cache, pool or "
                                       "drafter and caught by a checker: list them, run one beside its fixed twin")
    verbs = bugs.add_subparsers(dest="verb", required=True, parser_class=parser_class)
    ls = verbs.add_parser("list", help="the catalogue: name, area, where it was found, its public report")
    ls.add_argument("--json", action="store_true", help="every field of every entry, as JSON")
    run = verbs.add_parser("run", help="run NAME with the bug planted and without: where the runs part, what the "
                                       "checker says (exit 0: reproduced and caught, 1: not)")
    run.add_argument("name", metavar="NAME")
    run.add_argument("--model", default=None, help="a named model or folder (default: the bug's own, the tiny model)")
    run.add_argument("--html", default=None, metavar="FILE", help="also write the replay of both runs side by side")


def run(args: argparse.Namespace) -> int:
    from ..bugs import catalog, reproduce

    if args.verb == "list":
        entries = catalog()
        if args.json:
            print(json.dumps([b.as_dict() for b in entries], indent=1))
            return 0
        width = max(len(b.name) for b in entries)
        area = None
        for b in entries:
            if b.area != area:
                area = b.area
                print(f"\n{area}")
            print(f"  {b.name:<{width}}  {b.engine}, {b.reference}")
        print(f"\n{len(entries)} bugs; kvexplore bugs run NAME to see one")
        return 0
    r = reproduce(args.name, model=args.model)
    print(r.explain())
    print(f"  ({r.seconds:.1f} s)")
    if args.html:
        from ..views.bug_page import save_bug_html

        print(f"replay written to {save_bug_html(r, args.html)}")
    return 0 if r.caught and r.first_divergence is not None else 1
