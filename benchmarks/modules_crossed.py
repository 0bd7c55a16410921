"""How many of kvexplore's modules one decode token and one Step click run code in, counted by following the calls
(``sys.setprofile`` records every Python function called, and the module each lives in).

A decode token: ``Generator(model, make_cache("preallocated", ...))`` on the packaged tiny model, after a prefill and
two warm steps, then one ``step()``. A Step click: an ``Explorer`` on the tiny model with its default lanes, after a
prefill and a warm step, then one ``step()`` (what the Step button calls). Prints each count and the modules by folder.

    python benchmarks/modules_crossed.py
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

import kvexplore

PACKAGE = Path(kvexplore.__file__).resolve().parent


def crossed(action) -> list[str]:
    """The kvexplore modules whose functions ``action()`` calls, directly or not."""
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(PACKAGE)):
                seen.add(str(Path(path).resolve().relative_to(PACKAGE.parent)))

    sys.setprofile(profile)
    try:
        action()
    finally:
        sys.setprofile(None)
    return sorted(seen)


def show(what: str, modules: list[str]) -> None:
    folders: dict[str, list[str]] = defaultdict(list)
    for m in modules:
        parts = Path(m).parts
        folders[parts[1] if len(parts) > 2 else "(top)"].append(Path(m).stem)
    print(f"{what}: {len(modules)} modules in {len(folders)} folders")
    for folder, names in sorted(folders.items()):
        print(f"  {folder:10s} {', '.join(names)}")


def main() -> None:
    model = kvexplore.load("tiny")
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, max_seq_len=64))
    gen.prefill("the cache keeps every key")
    gen.step()
    gen.step()
    show("a decode token (Generator.step, preallocated)", crossed(gen.step))
    ex = kvexplore.Explorer(model)
    ex.prefill("the cache keeps every key")
    ex.step()
    show(f"a Step click (Explorer.step, lanes {', '.join(ex.lanes)})", crossed(ex.step))


if __name__ == "__main__":
    main()
