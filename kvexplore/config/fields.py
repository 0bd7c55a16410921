"""Checked reading of config values: a small table of fields per file, each with a type and a range. Every value a
model file gives goes through :func:`read`, which raises one :class:`~kvexplore.errors.ConfigError` naming the file,
the field, the value found and what was expected; :func:`read_json_object` reads a JSON file the same way."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, CorruptFileError, MissingFileError

INT, FLOAT, BOOL, STR, IDS, DICT, STR_LIST = "int", "float", "bool", "str", "ids", "dict", "str_list"
_EXPECTED = {INT: "an integer", FLOAT: "a finite number", BOOL: "true or false (a JSON boolean, not a string)",
             STR: "a string", IDS: "a token id or a list of token ids", DICT: "an object ({...})",
             STR_LIST: "a list of strings"}


@dataclass(frozen=True)
class Field:
    """One field: ``key`` in the file, its ``kind``, an inclusive range ``lo..hi`` (``lo_open``: strictly above
    ``lo``), whether it must be present, and whether ``null`` stands for "not given"."""

    key: str
    kind: str
    lo: float | None = None
    hi: float | None = None
    required: bool = False
    lo_open: bool = False
    nullable: bool = True
    hint: str = ""

    def expected(self) -> str:
        text = _EXPECTED[self.kind]
        if self.lo is not None and self.hi is not None and not self.lo_open:
            text += f" in {_num(self.lo)}..{_num(self.hi)}"
        elif self.lo is not None:
            text += f" {'>' if self.lo_open else '>='} {_num(self.lo)}"
            if self.hi is not None:
                text += f" and <= {_num(self.hi)}"
        elif self.hi is not None:
            text += f" <= {_num(self.hi)}"
        return text + (f" ({self.hint})" if self.hint else "")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def check(value: Any, field: Field, where: str) -> Any:
    """``value`` converted to the field's kind, or a ConfigError. ``None`` passes through for nullable fields."""
    if value is None and field.nullable and not field.required:
        return None
    parse = _PARSERS.get(field.kind)
    if parse is None:  # pragma: no cover - a mistake in a field table
        raise AssertionError(f"unknown field kind {field.kind!r}")
    out = parse(value, field)
    if out is _BAD:
        raise ConfigError(where, field.key, value, field.expected())
    return out


_BAD = object()  # what a parser returns for a value of the wrong type or out of range


def _in_range(out: float, field: Field) -> Any:
    if field.lo is not None and (out <= field.lo if field.lo_open else out < field.lo):
        return _BAD
    if field.hi is not None and out > field.hi:
        return _BAD
    return out


def _parse_int(value: Any, field: Field) -> Any:
    out = _as_int(value)
    return _BAD if out is None else _in_range(out, field)


def _parse_float(value: Any, field: Field) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return _BAD
    return _in_range(float(value), field)


def _parse_ids(value: Any, field: Field) -> Any:
    items = value if isinstance(value, list) else [value]
    ids = [_as_int(v) for v in items]
    return _BAD if any(i is None or _in_range(i, field) is _BAD for i in ids) else ids


def _of_type(*types: type, each: type | None = None):
    """A parser that accepts values of ``types`` as they are (lists: every element of type ``each``)."""
    def parse(value: Any, field: Field) -> Any:
        bad = not isinstance(value, types) or (each is not None and not all(isinstance(v, each) for v in value))
        return _BAD if bad else value
    return parse


# one parser per field kind: (value, field) -> the checked value, or _BAD
_PARSERS = {INT: _parse_int, FLOAT: _parse_float, BOOL: _of_type(bool), STR: _of_type(str), DICT: _of_type(dict),
            STR_LIST: _of_type(list, each=str), IDS: _parse_ids}


def _as_int(value: Any) -> int | None:
    """An int, or a float that is one (``64.0``); never a bool or a string."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def read(raw: Mapping[str, Any], fields: Iterable[Field], where: str) -> dict[str, Any]:
    """Every field of the table, checked: ``{key: value}`` with ``None`` where an optional field is absent."""
    out: dict[str, Any] = {}
    missing = []
    for f in fields:
        if f.key not in raw or (raw[f.key] is None and f.required):
            if f.required:
                missing.append(f.key)
            out[f.key] = None
            continue
        out[f.key] = check(raw[f.key], f, where)
    if missing:
        raise ConfigError(where, ", ".join(missing), None, "", message=(
            f"{where}: required field{'s' * (len(missing) > 1)} {', '.join(missing)} missing (or null); is this "
            f"the file saved with the model?"))
    return out


def read_json_object(path: Path, what: str = "", required: bool = True) -> dict[str, Any] | None:
    """The JSON object in ``path``; ``None`` when the file is absent and not ``required``."""
    if not path.exists():
        if not required:
            return None
        raise MissingFileError(f"{path} not found{': ' + what if what else ''}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptFileError(f"{path} is not UTF-8 text (byte {e.start} is {e.object[e.start]:#04x}); it is "
                               f"probably damaged: download or write it again") from e
    except OSError as e:
        raise CorruptFileError(f"{path} could not be read ({e})") from e
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CorruptFileError(f"{path} is not valid JSON ({e}); fix the file, or download it again") from e
    if not isinstance(raw, dict):
        raise CorruptFileError(f"{path} holds a JSON {type(raw).__name__}, expected an object ({{...}}) at the top "
                               f"level; is this the right file?")
    return raw
