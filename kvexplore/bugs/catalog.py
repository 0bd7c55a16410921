"""The zoo's catalogue: one :class:`Bug` per cache bug, registered by its area's module (:data:`MODULES`) and listed
by :func:`catalog` in the order of :data:`AREAS`."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.registry import Registry
from ..errors import SettingsError

#: the areas of the catalogue, in the order it lists them
AREAS = ("plain decoding", "rings and windows", "speculation", "prefix sharing", "quantization", "eviction",
         "prefill and decode apart")

#: the checker that judges each kind of run: the cache doctor (cached decoding against a recomputation), the pool
#: check (each served request against the same request on an empty pool), the speculation check (each verification
#: against plain decoding, and the cache after each take-back against a recomputation), the handoff check (the decode
#: side's keys and values, position by position, against what the prefill side computed)
CHECKERS = ("doctor", "pool", "speculation", "handoff")


@dataclass(frozen=True)
class Bug:
    """One catalogued bug: where it was found (``engine``, ``reference``, ``url``), ``area`` (one of :data:`AREAS`),
    ``summary``, ``invariant`` (what a correct cache keeps true), ``symptom``, ``model`` (the zoo model it runs on) and
    ``checker`` (one of :data:`CHECKERS`).

    ``run(model, planted) -> Run`` runs its prompts, steps or requests once, with the bug planted or with kvexplore's
    own classes; ``check(model, planted)`` runs the checker on the same. ``make(model, planted, slots)``: a decoding
    bug's ``(model, cache)`` or a speculation bug's generator (what an explorer lane of it runs); None for a pool's
    bug."""

    name: str
    engine: str
    reference: str
    url: str
    area: str
    summary: str
    invariant: str
    symptom: str
    checker: str
    run: Callable[[Any, bool], Any]
    check: Callable[[Any, bool], Any]
    model: str = "tiny"
    make: Callable[..., Any] | None = None

    def as_dict(self) -> dict[str, str]:
        """The catalogue entry in plain fields (what ``kvexplore bugs list --json`` prints)."""
        return {"name": self.name, "engine": self.engine, "reference": self.reference, "url": self.url,
                "area": self.area, "summary": self.summary, "invariant": self.invariant, "symptom": self.symptom,
                "checker": self.checker, "model": self.model}


BUGS: Registry = Registry("bug", "unregister")  # the zoo's own, sealed once every module has registered

#: the modules of this package that register bugs, in the order of the catalogue's areas
MODULES = ("decoding", "windows", "speculation", "prefix", "quantization", "eviction", "disaggregation")


def load_all() -> None:
    """Import every bug module (each registers its bugs once); the bugs there are then the built-in ones."""
    if BUGS.built_in:
        return
    for name in MODULES:
        module = f"{__package__}.{name}"
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    BUGS.seal()


def register(bug: Bug, replace: bool = False) -> Bug:
    """Add ``bug`` to the catalogue (a taken name is refused unless ``replace``; never a built-in one's): a bug of
    your own is listed, reproduced and run by ``kvexplore bugs`` like the zoo's."""
    if not isinstance(bug, Bug):
        raise SettingsError(f"register a kvexplore.bugs.Bug, got {type(bug).__name__}")
    if bug.area not in AREAS:
        raise SettingsError(f"bug {bug.name!r}: area must be one of {AREAS}, got {bug.area!r}")
    if bug.checker not in CHECKERS:
        raise SettingsError(f"bug {bug.name!r}: checker must be one of {CHECKERS}, got {bug.checker!r}")
    return BUGS.add(bug.name, bug, replace)


def unregister(name: str) -> Bug:
    """Remove a bug :func:`register` added after the zoo's own; returns it."""
    return BUGS.remove(name)


def catalog() -> list[Bug]:
    """Every catalogued bug, by area (in the order of :data:`AREAS`), then as registered."""
    load_all()
    order = {a: i for i, a in enumerate(AREAS)}
    return sorted(BUGS.values(), key=lambda b: order[b.area])


def get(name: str) -> Bug:
    """The bug named ``name``, or a SettingsError listing the names there are."""
    load_all()
    if not isinstance(name, str) or name not in BUGS:
        raise SettingsError(f"no bug named {name!r} in the zoo; the catalogue has: {', '.join(sorted(BUGS))} "
                            f"(kvexplore bugs list)")
    return BUGS[name]
