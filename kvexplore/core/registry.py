"""One rule for every registry of named extensions: registering a taken name is refused unless asked to replace it, a
built-in entry is neither replaced nor removed, and removing a name that is not there says what is. A built-in entry
may be named before it is loaded (:meth:`Registry.add_lazy`): its module is imported at its first look-up."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ..errors import SettingsError


class _Unloaded:
    """An entry named by where it lives, imported at its first look-up."""

    def __init__(self, where: str) -> None:
        self.where = where

    def load(self) -> Any:
        module, _, attribute = self.where.partition(":")
        return getattr(import_module(module), attribute)


class Registry(dict):
    """Names -> entries of one kind of extension. ``what`` names an entry in messages; ``unregister``
    names the function that removes one."""

    def __init__(self, what: str, unregister: str) -> None:
        super().__init__()
        self.what = what
        self.unregister = unregister
        self.built_in: frozenset[str] = frozenset()

    def add(self, name: str, entry: Any, replace: bool = False) -> Any:
        """Register ``entry`` as ``name`` (returned). A taken name is refused unless ``replace`` (never a built-in
        one); registering the same entry (or an equal one) again changes nothing."""
        if not isinstance(name, str) or not name:
            raise SettingsError(f"{_a(self.what)}'s name is a non-empty string, got {name!r}")
        if name in self and (self[name] is entry or self[name] == entry):
            return self[name]
        if name in self.built_in:
            raise SettingsError(f"{self.what} {name!r} is built in and cannot be replaced; register yours under "
                                f"another name")
        if name in self and not replace:
            raise SettingsError(f"{_a(self.what)} named {name!r} is already registered ({_label(self[name])}); pick "
                                f"another name, pass replace=True, or call {self.unregister}({name!r}) first")
        self[name] = entry
        return entry

    def add_lazy(self, name: str, where: str) -> None:
        """Name a built-in entry that ``where`` (``"package.module:attribute"``) holds; loaded at its first look-up.
        Seal the registry after these (they are built in)."""
        dict.__setitem__(self, name, _Unloaded(where))

    def __getitem__(self, name: str) -> Any:
        entry = dict.__getitem__(self, name)
        if isinstance(entry, _Unloaded):
            entry = entry.load()
            dict.__setitem__(self, name, entry)
        return entry

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default

    def values(self) -> list[Any]:  # type: ignore[override]
        return [self[name] for name in self]

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        return [(name, self[name]) for name in self]

    def pop(self, name: str, *default: Any) -> Any:  # type: ignore[override]
        if name in self:
            entry = self[name]
            dict.pop(self, name)
            return entry
        return dict.pop(self, name, *default)

    def remove(self, name: str) -> Any:
        """Remove ``name`` (an entry registered after the built-in ones); returns its entry."""
        if name in self.built_in:
            raise SettingsError(f"{self.what} {name!r} is built in; only {_a(self.what)} registered later can be "
                                f"removed")
        if name not in self:
            raise SettingsError(f"no {self.what} named {name!r} is registered; registered: {', '.join(self)}")
        return self.pop(name)

    def seal(self) -> None:
        """Mark every entry registered so far as built in."""
        self.built_in = frozenset(self)


def _label(entry: Any) -> str:
    return getattr(entry, "__qualname__", None) or type(entry).__name__


def _a(what: str) -> str:
    return ("an " if what[0] in "aeiou" else "a ") + what
