"""A zoo of real cache bugs: each planted in a subclass of kvexplore's own cache, pool or drafter (never as a flag in
the real code paths), run beside its fixed twin, and caught by a checker (docs/bugs.md)."""

from __future__ import annotations

from .catalog import AREAS, MODULES, Bug, catalog, get, load_all, register, unregister
from .reproduction import Reproduction, reproduce
from .runs import Divergence, Run

__all__ = ["AREAS", "MODULES", "Bug", "Divergence", "Reproduction", "Run", "catalog", "get", "load_all", "register",
           "reproduce", "unregister"]

