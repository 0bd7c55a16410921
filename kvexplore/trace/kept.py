"""How a run's :class:`~kvexplore.trace.files.History` keeps its older records: the newest :data:`KEEP_STEPS` as they
were appended, each older one as a compact :class:`KeptStep` (docs/tracing.md#a-long-runs-records), rebuilt by
:meth:`KeptRecords.record` as the :class:`~kvexplore.trace.records.StepRecord` it was."""

from __future__ import annotations

import struct
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

from ..caches.memory import LayerMemory, MemoryReport
from .kept_trace import KeptTrace
from .later import build_later
from .records import Candidate, StepRecord

KEEP_STEPS = 8  # records kept as they are (a verification of up to 7 drafts gives 8 records; the views read the newest)
REBUILT = 16  # records given back that are kept (asking for one again gives the same object)

_NONE = -(2 ** 63)  # an optional int (a draft token, a verification) that is None
_NUMBERS = struct.Struct("<5q3d?2q")  # step, token_id, position, input_len, cache_length, prob, forward_s, sample_s,
# is_eos, draft_token, verification
_CANDIDATE = struct.Struct("<qd")  # token id, probability (exact)
_MEMORY_INTS = tuple(f.name for f in fields(MemoryReport) if f.type == "int")
_MEMORY_DICTS = tuple(f.name for f in fields(MemoryReport) if f.type.startswith("dict"))
_LAYER_INTS = tuple(f.name for f in fields(LayerMemory) if f.type == "int")
_LAYER, _LAYER_WIDE = f"<{len(_LAYER_INTS)}i", f"<{len(_LAYER_INTS)}q"  # a layer's figures (int32 where they fit)


@dataclass(frozen=True, eq=False, slots=True)
class KeptMemory:
    """A :class:`MemoryReport` kept: its int figures in one bytes object, its layers' figures as one row each."""

    figures: bytes
    dicts: tuple[dict, ...]  # _MEMORY_DICTS' values (the step kept before's objects when equal)
    layers: bytes  # one row of _LAYER_INTS per layer: _LAYER, or _LAYER_WIDE when a figure needs 64 bits
    wide: bool
    kinds: tuple[str, ...]
    parts: tuple[tuple[tuple[str, int], ...], ...]

    @classmethod
    def of(cls, report: MemoryReport, before: "KeptMemory | None") -> "KeptMemory":
        dicts = tuple(getattr(report, name) for name in _MEMORY_DICTS)
        if before is not None:
            dicts = tuple(b if b == d else d for d, b in zip(dicts, before.dicts))
        rows = [getattr(m, f) for m in report.layers for f in _LAYER_INTS]
        wide = any(v > 2 ** 31 - 1 for v in rows)  # (every figure is 0 or more)
        kinds = tuple(m.kind for m in report.layers)
        parts = tuple(tuple(m.parts.items()) for m in report.layers)
        return cls(struct.pack(f"<{len(_MEMORY_INTS)}q", *(getattr(report, f) for f in _MEMORY_INTS)), dicts,
                   struct.pack(f"<{len(rows)}{'q' if wide else 'i'}", *rows), wide,
                   before.kinds if before is not None and before.kinds == kinds else kinds,
                   before.parts if before is not None and before.parts == parts else parts)

    def report(self) -> MemoryReport:
        rows = struct.iter_unpack(_LAYER_WIDE if self.wide else _LAYER, self.layers)
        layers = tuple(LayerMemory(**dict(zip(_LAYER_INTS, row)), kind=kind, parts=dict(parts))
                       for row, kind, parts in zip(rows, self.kinds, self.parts))
        return MemoryReport(**dict(zip(_MEMORY_INTS, struct.unpack(f"<{len(_MEMORY_INTS)}q", self.figures))),
                            **dict(zip(_MEMORY_DICTS, self.dicts)), layers=layers)


def _gone() -> None:  # a weak reference to a trace no record holds
    return None


def _optional(value: int | None) -> int:
    return _NONE if value is None else value


def _given(value: int) -> int | None:
    return None if value == _NONE else value


@dataclass(frozen=True, eq=False, slots=True)
class KeptStep:
    """One record kept (see the module's docstring)."""

    numbers: bytes  # _NUMBERS
    kind: str
    text: str
    top: bytes  # _CANDIDATE per candidate
    top_texts: tuple[str, ...]
    memory: KeptMemory | None
    trace: KeptTrace | None

    def record(self, trace: Callable[[KeptTrace], Any]) -> StepRecord:
        """The record kept; its candidates, memory report and trace (``trace(kept)``: records of a verification share
        one) are built when first read."""
        step, token_id, position, input_len, cache_length, prob, forward_s, sample_s, is_eos, draft, verification = \
            _NUMBERS.unpack(self.numbers)
        out = StepRecord(step=step, kind=self.kind, token_id=token_id, text=self.text, position=position,
                         input_len=input_len, cache_length=cache_length, prob=prob, forward_s=forward_s,
                         sample_s=sample_s, is_eos=is_eos, draft_token=_given(draft), verification=_given(verification))
        later = {"top": self.candidates}
        if self.memory is not None:
            later["memory"] = self.memory.report
        if self.trace is not None:
            later["trace"] = partial(trace, self.trace)
        return build_later(out, **later)

    def candidates(self) -> list[Candidate]:
        return [Candidate(token, text, p) for (token, p), text in zip(_CANDIDATE.iter_unpack(self.top), self.top_texts)]


class KeptRecords:
    """The older records of one history, kept (:class:`KeptStep`), in step order."""

    def __init__(self) -> None:
        self.steps: list[KeptStep] = []
        self._live: tuple[Any, KeptTrace] | None = None  # the trace kept last: (a weak reference to it, it kept)
        self._rebuilt: OrderedDict[int, StepRecord] = OrderedDict()  # index -> the record given back (REBUILT)
        self._traces: OrderedDict[int, tuple[KeptTrace, Any]] = OrderedDict()  # id(kept) -> (kept, trace rebuilt)

    def __len__(self) -> int:
        return len(self.steps)

    def append(self, record: StepRecord) -> None:
        before = self.steps[-1] if self.steps else None
        trace = None
        if record.trace is not None:
            if self._live is not None and self._live[0]() is record.trace:  # a verification's records share one
                trace = self._live[1]
            else:
                last = self._live[1] if self._live is not None else None
                trace = KeptTrace.of(record.trace, last)
                self._live = (weakref.ref(record.trace), trace)
        memory = None if record.memory is None else \
            KeptMemory.of(record.memory, before.memory if before is not None else None)
        self.steps.append(KeptStep(
            _NUMBERS.pack(record.step, record.token_id, record.position, record.input_len, record.cache_length,
                          record.prob, record.forward_s, record.sample_s, record.is_eos,
                          _optional(record.draft_token), _optional(record.verification)),
            record.kind, record.text, b"".join(_CANDIDATE.pack(c.token_id, c.prob) for c in record.top),
            tuple(c.text for c in record.top), memory, trace))

    def record(self, i: int) -> StepRecord:
        """Record ``i`` (0 <= i < len(self)) as it was appended."""
        hit = self._rebuilt.get(i)
        if hit is not None:
            self._rebuilt.move_to_end(i)
            return hit
        self._rebuilt[i] = out = self.steps[i].record(self._trace)
        while len(self._rebuilt) > REBUILT:
            self._rebuilt.popitem(last=False)
        return out

    def _trace(self, kept: KeptTrace) -> Any:
        hit = self._traces.get(id(kept))
        if hit is not None and hit[0] is kept:
            self._traces.move_to_end(id(kept))
            return hit[1]
        out = kept.trace()
        self._traces[id(kept)] = (kept, out)
        while len(self._traces) > REBUILT:
            self._traces.popitem(last=False)
        return out

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` records only (a rewind); the next one kept is kept against record ``n - 1``."""
        del self.steps[n:]
        self._live = (_gone, self.steps[-1].trace) if self.steps and self.steps[-1].trace is not None else None
        self._rebuilt = OrderedDict((i, r) for i, r in self._rebuilt.items() if i < n)

    def copy(self) -> "KeptRecords":
        """The same records (kept steps are never changed: the two share them), for a history of its own."""
        twin = KeptRecords()
        twin.steps, twin._live = list(self.steps), self._live
        return twin
