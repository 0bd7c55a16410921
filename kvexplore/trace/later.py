"""Fields built when first read: ``@built_later("memory", ...)`` on a dataclass lets :func:`build_later` leave those
fields of one object unset; each becomes a :class:`Later`, which builds the value when the field is first read and
stores it on the object. An older record of a history is given back so, without building all of it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING
from typing import Any


class Later:
    """The class attribute of a field that :func:`build_later` may leave unset on an object (see the module)."""

    def __init__(self, name: str, default: Any) -> None:
        self.name, self.default = name, default

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        later = {} if obj is None else obj.__dict__.get("_later", {})
        if self.name not in later:  # the class's default, as the dataclass's class attribute gave
            if self.default is MISSING:
                raise AttributeError(f"{self.name!r} is not set")
            return self.default
        value = later[self.name]()
        obj.__dict__["_later"] = {k: v for k, v in later.items() if k != self.name}  # (a copy may share the dict)
        obj.__dict__[self.name] = value
        return value


def built_later(*names: str) -> Callable[[type], type]:
    """A class decorator, over ``@dataclass``: these fields may be built when first read (:func:`build_later`)."""

    def decorate(cls: type) -> type:
        for name in names:
            setattr(cls, name, Later(name, cls.__dataclass_fields__[name].default))
        return cls

    return decorate


def build_later(obj: Any, **fields: Callable[[], Any]) -> Any:
    """Leave these fields of ``obj`` unset, each built by its function (no arguments) when first read; ``obj``."""
    for name in fields:
        if not isinstance(type(obj).__dict__.get(name), Later):
            raise TypeError(f"{type(obj).__name__}.{name} is not built later (see @built_later)")
        obj.__dict__.pop(name, None)
    obj.__dict__["_later"] = {**obj.__dict__.get("_later", {}), **fields}
    return obj
