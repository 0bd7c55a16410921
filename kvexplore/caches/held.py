"""What a cache object really holds: every tensor storage reachable from it, each counted once, named by the part it
belongs to (docs/strategies.md, "Held"): what a ``del cache`` would give back. :class:`torch.nn.Module` objects (the
model's rotary a cache may reference) are not entered.

Each storage goes to the first part that reaches it, in this order: every layer's keys and values
(``layer.storage()``), each layer's other attributes (named by :func:`~.layer.held_label`: its class's
``_held_names``, else the attribute's own name), the container's own attributes, and last what only the step under
way holds (its undo journal and reads), which :meth:`~.base.KVCache.settle` lets go. Each part is thus the memory
that would be freed with it alone."""

from __future__ import annotations

import enum
import gc
import types
from typing import Any, Iterable

import torch

from ..config.layer_plan import LayerSpec
from ..core.allocator import Window
from .memory import LayerMemory, MemoryReport, StepCounters

KEYS_AND_VALUES = "keys and values"
UNDO_SCRATCH = "undo scratch"
THIS_STEP = "this step (undo journal, reads, masks)"

_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, torch.Size, range, type,
          enum.Enum, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
#: types that hold no tensor and are skipped without a look (a walk meets many of them): Python's and torch's
#: values, and the records a cache keeps of its shape and figures (a layer's spec, memory reports, counters)
PLAIN = frozenset({str, int, float, bool, type(None), torch.dtype, torch.device, types.MethodType,
                   LayerSpec, LayerMemory, MemoryReport, StepCounters, Window})


class StorageWalk:
    """Counts tensor storages reachable from objects, each storage once across every :meth:`add` (by its
    address), and remembers how many bytes each named part brought."""

    def __init__(self) -> None:
        self._storages: set[int] = set()  # data_ptr of each storage counted
        self._objects: set[int] = set()
        self.parts: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def add(self, part: str, *objects: Any) -> int:
        """Walk ``objects`` and add the bytes of the storages not counted before to ``part``; returns them."""
        got = 0
        stack = list(objects)
        objects_seen, plain = self._objects, PLAIN
        while stack:
            o = stack.pop()
            cls = type(o)
            if cls in plain:
                continue
            if cls is torch.Tensor or isinstance(o, torch.Tensor):
                got += self._tensor(o)
                continue
            if id(o) in objects_seen or isinstance(o, _ATOMS) or isinstance(o, torch.nn.Module):
                continue
            objects_seen.add(id(o))
            if cls is list or cls is tuple or isinstance(o, (list, tuple, set, frozenset)):
                if len(o) > 8 and cls is not set and cls is not frozenset and _flat(o):
                    continue  # positions, counts: numbers only (checked at both ends and the middle)
                stack.extend(o)
            elif isinstance(o, dict):
                stack.extend(o.values())
                stack.extend(k for k in o if type(k) not in plain)
            else:
                stack.extend(_attributes(o))
        if got:
            self.parts[part] = self.parts.get(part, 0) + got
        return got

    def walked(self, *objects: Any) -> None:
        """Take ``objects`` as walked already (their contents were added another way): a later walk that meets them
        again (a list of the cache's own layers) does not enter them."""
        self._objects.update(id(o) for o in objects)

    def add_tensor(self, part: str, t: torch.Tensor) -> int:
        """:meth:`add` for one tensor, without the walk (the memory report's per-layer call at every step)."""
        if got := self._tensor(t):
            self.parts[part] = self.parts.get(part, 0) + got
        return got

    def _tensor(self, t: torch.Tensor) -> int:
        if t.layout != torch.strided:  # sparse: count its parts
            return sum(self._tensor(p) for p in _components(t))
        s = t.untyped_storage()
        key = s.data_ptr()
        if key in self._storages or not key:
            return 0
        self._storages.add(key)
        return s.nbytes()


def _flat(seq: list | tuple) -> bool:
    return isinstance(seq[0], _ATOMS) and isinstance(seq[-1], _ATOMS) and isinstance(seq[len(seq) // 2], _ATOMS)


def _attributes(o: Any) -> Iterable[Any]:
    """The values an object holds: its ``__dict__`` and its ``__slots__`` (a class's own attributes are shared)."""
    d = getattr(o, "__dict__", None)
    if isinstance(d, dict):
        yield from d.values()
    for cls in type(o).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__"):
                value = getattr(o, name, None)
                if value is not None:
                    yield value


def _components(t: torch.Tensor) -> list[torch.Tensor]:
    if t.is_sparse:
        return [t._indices(), t._values()]
    return [t.values(), t.indices()] if t.layout in (torch.sparse_csr, torch.sparse_csc) else []


def referents_bytes(obj: Any) -> int:
    """Bytes of every tensor storage reachable from ``obj`` through the garbage collector's referents, each storage
    once: the count a report's ``held_bytes + step_bytes`` is checked against (the tests, the memory benchmark). It
    walks what :class:`StorageWalk` does not (closures, C-level members) and needs no label; a model (an nn.Module),
    classes, modules and functions are not entered."""
    seen, storages, stack = set(), {}, [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            continue
        if isinstance(o, (torch.nn.Module, type, types.ModuleType, types.FunctionType, str, bytes, int, float)):
            continue
        stack.extend(gc.get_referents(o))
    return sum(n for ptr, n in storages.items() if ptr)
