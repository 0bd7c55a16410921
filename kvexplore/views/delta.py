"""What changed in a figure, as a patch on an earlier one: the delta protocol between the kernel and the page.

A figure is ``{"data": [trace, ...], "layout": {...}}``. :func:`diff` gives the patch that turns ``base`` into
``new``; :func:`apply` applies it (the page runs the same logic in JavaScript: ``delta.js``, :data:`APPLY_JS`). A
patch is ``{"data": [changes of trace 0, ...], "layout": changes}`` where ``changes`` maps a property to its new
value, to :data:`DELETE` (the property is gone), or for an array or list that kept most of its items to a splice
``{"$splice": [start, stop, items]}`` (``old[:start] + items + old[stop:]``) or, when one item of a list is itself
what changed, ``{"$in": [index, change of that item]}``. Patches are always taken against the same base, so the
page draws ``apply(base, patch)`` from the two synced values alone, however many patches it missed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import assets

DELETE = {"$del": 1}


def same(a: Any, b: Any) -> bool:
    """Whether two values of a figure are equal (arrays by dtype and contents, NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.shape == b.shape
                and a.dtype == b.dtype and bool(np.array_equal(a, b, equal_nan=np.issubdtype(a.dtype, np.floating))))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True  # NaN
    return type(a) is type(b) and a == b


def _differ(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = a != b
    return d & ~(np.isnan(a) & np.isnan(b)) if np.issubdtype(a.dtype, np.floating) else d


def _ends(old, new) -> tuple[int, int, int]:
    """The common prefix of ``old`` and ``new`` and where the differing middle stops in each."""
    n = min(len(old), len(new))
    if isinstance(old, np.ndarray):
        head = np.flatnonzero(_differ(old[:n], new[:n]))
        tail = np.flatnonzero(_differ(old[len(old) - n:][::-1], new[len(new) - n:][::-1]))
        start, end = (int(head[0]) if len(head) else n), (int(tail[0]) if len(tail) else n)
    else:
        start = next((i for i in range(n) if not same(old[i], new[i])), n)
        end = next((i for i in range(n) if not same(old[-1 - i], new[-1 - i])), n)
    end = min(end, n - start)  # the prefix and the suffix do not overlap
    return start, len(old) - end, len(new) - end


def change(old: Any, new: Any) -> Any:
    """How to turn ``old`` into ``new`` (``new`` itself when no smaller form fits). Call only when they differ."""
    arrays = (isinstance(old, np.ndarray) and isinstance(new, np.ndarray) and old.ndim == new.ndim == 1
              and old.dtype == new.dtype)
    lists = isinstance(old, list) and isinstance(new, list)
    if not (arrays or lists) or not len(old) or not len(new):
        return new
    start, stop_old, stop_new = _ends(old, new)
    if lists and stop_old - start == 1 == stop_new - start and isinstance(old[start], (list, np.ndarray)):
        return {"$in": [start, change(old[start], new[start])]}
    if (stop_new - start) * 2 > len(new):
        return new  # most of it changed: the whole value is as small
    return {"$splice": [start, stop_old, new[start:stop_new]]}


def _changes(base: dict, new: dict) -> dict:
    out = {k: DELETE for k in base if k not in new}
    out.update({k: v if k not in base else change(base[k], v) for k, v in new.items()
                if k not in base or not same(base[k], v)})
    return out


def diff(base: dict, new: dict) -> dict | None:
    """The patch turning figure ``base`` into figure ``new``; None when they do not have the same traces of the same
    types (a patch would be as big as the figure: send ``new`` as the base instead)."""
    b, n = base.get("data", []), new.get("data", [])
    if len(b) != len(n) or any(x.get("type") != y.get("type") for x, y in zip(b, n)):
        return None
    return {"data": [_changes(x, y) for x, y in zip(b, n)], "layout": _changes(base.get("layout", {}),
                                                                                new.get("layout", {}))}


def _apply_value(old: Any, v: Any) -> Any:
    if isinstance(v, dict) and "$splice" in v:
        start, stop, items = v["$splice"]
        if isinstance(old, np.ndarray):
            return np.concatenate([old[:start], np.asarray(items, dtype=old.dtype), old[stop:]])
        return [*old[:start], *items, *old[stop:]]
    if isinstance(v, dict) and "$in" in v:
        i, sub = v["$in"]
        out = list(old)
        out[i] = _apply_value(old[i], sub)
        return out
    return v


def _deleted(v: Any) -> bool:
    return isinstance(v, dict) and v.get("$del") == 1


def _apply_changes(base: dict, changes: dict) -> dict:
    out = {k: v for k, v in base.items() if not _deleted(changes.get(k))}
    out.update({k: _apply_value(base.get(k), v) for k, v in changes.items() if not _deleted(v)})
    return out


def apply(base: dict, patch: dict | None) -> dict:
    """Figure ``base`` with ``patch`` applied (``base`` is not changed); an empty or missing patch gives ``base``."""
    if not patch or "data" not in patch:
        return base
    return {"data": [_apply_changes(t, c) for t, c in zip(base.get("data", []), patch["data"])],
            "layout": _apply_changes(base.get("layout", {}), patch["layout"])}


def weight(value: Any) -> int:
    """About how many bytes ``value`` takes on the wire (arrays by their bytes, text by its length)."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(len(k) + 3 + weight(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 2 + sum(weight(v) + 1 for v in value)
    if isinstance(value, str):
        return len(value) + 2
    return 8


# the page's copy of apply(): the same steps on decoded values (typed arrays for numeric buffers)
APPLY_JS = assets.text(__file__, "delta.js")
