"""Checks for arguments and settings given in Python (cache sizes, sampling, steps, rewinds): each takes the value
and its name and returns the value, or raises a :class:`~kvexplore.errors.SettingsError` saying what was given
and what is allowed. ``True`` is not an integer here, and ``2.5`` is not a ``top_k``."""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from ..errors import SettingsError


def shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(value: Any, name: str, minimum: int | None = None, maximum: int | None = None, hint: str = "") -> int:
    """``value`` as an int (Python or numpy integers; not bools, floats or strings) within the bounds."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise SettingsError(f"{name} must be an integer{hint}, got {shown(value)} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum or maximum is not None and value > maximum:
        bounds = (f"between {minimum} and {maximum}" if minimum is not None and maximum is not None
                  else f"at least {minimum}" if minimum is not None else f"at most {maximum}")
        raise SettingsError(f"{name} must be {bounds}{hint}, got {value}")
    return value


def positive_int(value: Any, name: str) -> int:
    return integer(value, name, minimum=1)


def real(value: Any, name: str, minimum: float | None = None, maximum: float | None = None,
         above: float | None = None, hint: str = "") -> float:
    """``value`` as a finite float (not a bool or a string) with ``minimum <= value <= maximum``, ``value > above``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise SettingsError(f"{name} must be a finite number{hint}, got {shown(value)}")
    value = float(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum) or (
            above is not None and value <= above):
        parts = [f">= {minimum}" if minimum is not None else "", f"> {above}" if above is not None else "",
                 f"<= {maximum}" if maximum is not None else ""]
        raise SettingsError(f"{name} must be {' and '.join(p for p in parts if p)}{hint}, got {value}")
    return value


def choice(value: Any, name: str, options: Any) -> Any:
    """``value`` if it is one of ``options`` (compared as given; unhashable values are refused too)."""
    try:
        ok = value in options
    except TypeError:
        ok = False
    if not ok:
        raise SettingsError(f"unknown {name} {shown(value)}; available: {', '.join(map(str, options))}")
    return value


def refused_options(build: Any, options: dict[str, Any], what: str, error: TypeError) -> SettingsError:
    """The error for ``build(**options)`` raising ``error`` (a TypeError): the options its signature does not take,
    by name, and the ones it does (what ``make_cache`` and ``make_press`` say); ``error`` itself when every option is
    a parameter (the TypeError came from inside)."""
    import inspect

    params = inspect.signature(build).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return SettingsError(f"{what}: {error}")
    unnamed = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    named = [n for n, p in params.items() if p.kind not in unnamed and n not in ("self", "cls", "config")]
    refused = sorted(set(options) - set(named))
    if not refused:
        return SettingsError(f"{what}: {error}")
    return SettingsError(f"{what} does not take {refused}; it takes {', '.join(named)}")
