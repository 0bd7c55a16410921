"""A zoo of real cache bugs: the bugs serving engines shipped (and a few this project made), each planted in
kvexplore's own cache, pool or drafter, run beside its fixed twin, and caught by a checker.

    import kvexplore.bugs as bugs
    [b.name for b in bugs.catalog()]             # name, engine, reference, area, summary, invariant
    r = bugs.reproduce("ring-rollback-after-wrap")
    r.first_divergence                            # step or request, layer, position, the two tokens
    r.doctor                                      # the checker's report on the broken run
    print(r.explain())

Planted bugs live here, in subclasses of kvexplore's classes (a cache, a layer, a pool, a rotary embedding), never
as flags in the real code paths. docs/bugs.md has one entry per bug.
"""

from __future__ import annotations

from .catalog import AREAS, MODULES, Bug, catalog, get, load_all, register, unregister
from .reproduction import Reproduction, reproduce
from .runs import Divergence, Run

__all__ = ["AREAS", "MODULES", "Bug", "Divergence", "Reproduction", "Run", "catalog", "get", "load_all", "register",
           "reproduce", "unregister"]

