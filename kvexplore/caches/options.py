"""A strategy's options, declared once: each strategy's module holds a frozen dataclass of them (``SinkCache.Options``),
checked when it is made and read by everything that offers them: :func:`~kvexplore.caches.factory.make_cache`,
``kvexplore generate`` (one flag per option), the app's lanes and the docs' tables. No code outside a strategy's module
names its options. An option is a field made by :func:`option`: its help, its check (``check(value, name)`` returns the
value, normalised, or raises naming the fix) and its command-line :class:`Flag` (None: Python only)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar

from ..core.settings import choice, integer
from ..errors import SettingsError

Check = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Flag:
    """How a command line gives an option: ``parse`` (int, float or str), ``choices``, ``switch`` (a flag that takes
    no value and sets True) and ``name`` (the flag when it is not ``--`` and the option's name with dashes)."""

    parse: Callable[[str], Any] = str
    choices: Sequence[Any] | None = None
    switch: bool = False
    name: str | None = None


@dataclass(frozen=True)
class OptionSpec:
    help: str
    check: Check | None
    flag: Flag | None


def option(default: Any = MISSING, *, help: str, check: Check | None = None, flag: Flag | None = Flag()) -> Any:
    """A field of a strategy's :class:`Options`: ``default`` (none: required), ``help`` (one phrase, its default
    included where the default is None), ``check`` and the command line's ``flag`` (None: Python only)."""
    return field(default=default, metadata={"option": OptionSpec(help, check, flag)})


# -- checks ---------------------------------------------------------------------------------------------------------
def positive(value: Any, name: str) -> int:
    return integer(value, name, minimum=1)


def count(value: Any, name: str) -> int:
    return integer(value, name, minimum=0)


def maybe(check: Check, none: str = "") -> Check:
    """``check``, or None ("not given"); ``none`` says what None means, in the message of a value refused."""
    def checked(value: Any, name: str) -> Any:
        if value is None:
            return None
        try:
            return check(value, name)
        except SettingsError as e:
            if none:
                raise SettingsError(f"{e} ({name}=None: {none})") from None
            raise
    return checked


def one_of(choices: Sequence[Any], label: str | None = None) -> Check:
    """One of ``choices`` ("unknown <label> ...; available: ..."; ``label`` defaults to the option's name)."""
    def check(value: Any, name: str) -> Any:
        return choice(value, label or name, choices)
    return check


def switch(value: Any, name: str) -> bool | None:
    """True or False (None passes)."""
    if value not in (None, True, False):
        raise SettingsError(f"{name} must be True or False, got {value!r}")
    return value


def number(low: float, high: float, why: str, high_open: bool = False) -> Check:
    """A real number in ``[low, high]`` (``[low, high)`` if ``high_open``; None passes), ``why`` saying what it is."""
    def check(value: Any, name: str) -> float | None:
        if value is None:
            return None
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and \
            low <= value and (value < high if high_open else value <= high)
        if not ok:
            raise SettingsError(f"{name} is {why}, from {low:g} up to {'(not including) ' if high_open else ''}"
                                f"{high:g}, got {value!r}")
        return float(value)
    return check


# -- the options of one strategy ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Options:
    """The base of every strategy's options (a frozen dataclass of :func:`option` fields). Subclasses add the
    checks across options in :meth:`validate`; :attr:`generate` and :attr:`app` are what ``kvexplore generate`` and a
    lane of ``kvexplore app`` start the strategy with when not told (so that it shows what it does in a short run)."""

    generate: ClassVar[Mapping[str, Any]] = {}
    app: ClassVar[Mapping[str, Any]] = {}

    def __post_init__(self) -> None:
        for f in fields(self):
            spec = f.metadata.get("option")
            if spec is not None and spec.check is not None:
                object.__setattr__(self, f.name, spec.check(getattr(self, f.name), f.name))
        self.validate()

    def validate(self) -> None:
        """Checks across options (each option's own check has run)."""

    @classmethod
    def specs(cls) -> list[tuple[Field, OptionSpec]]:
        """Each option's field and spec, in declaration order."""
        return [(f, f.metadata["option"]) for f in fields(cls) if "option" in f.metadata]

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f, _ in cls.specs()]

    @classmethod
    def refuse_unknown(cls, given: Mapping[str, Any], what: str) -> None:
        """Refuse, naming what it takes, an option ``what`` (e.g. "cache kind 'sink'") does not take."""
        unknown = sorted(name for name in given if name not in cls.names())
        if unknown:
            takes = ", ".join(cls.names()) or "no options of its own"
            raise SettingsError(f"{what} does not take {unknown}; it takes {takes}")

    @classmethod
    def sizing(cls, slots: int, options: dict[str, Any]) -> int | None:
        """How :func:`~kvexplore.caches.factory.make_cache` sizes the strategy from ``slots`` (``max_seq_len``, or the
        model's context): add to ``options`` what the constructor needs, and return the positions per sequence its
        storage will hold (checked against the device's memory before allocating; None: it grows, no check). By
        default a strategy that takes ``max_seq_len`` gets ``slots`` of them."""
        if "max_seq_len" not in cls.names():
            return None
        options["max_seq_len"] = slots
        return slots

    @classmethod
    def fitted(cls, options: dict[str, Any], given: Mapping[str, Any], max_seq_len: int | None) -> dict[str, Any]:
        """The app's ``options`` for a lane whose caches hold ``max_seq_len`` slots (``given``: those the user
        gave, kept as they are); a strategy adjusts its own defaults to that size here."""
        return options
