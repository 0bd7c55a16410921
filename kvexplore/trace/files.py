"""Saving and loading a run's records: one safetensors file, tensors as tensors and the rest as JSON metadata,
versioned (a file of a newer format is refused, saying so); read back with no model."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, MutableSequence
from dataclasses import asdict, fields
from importlib import import_module
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..caches.base import SlotView
from ..caches.layout import LinearLayout, layout_from_dict
from ..errors import CorruptFileError, LoadError, MissingFileError, StateError
from ..caches.memory import LayerMemory, MemoryReport
from . import kept
from .kept import KeptRecords
from .kept_trace import distinct
from .records import Candidate, StepRecord
from .press import PressOutcome, press_from_row, press_row
from .ranks import RankStep
from .tracer import AttentionHistory, CacheEvent, StepTrace

FORMAT = "kvexplore-trace"
VERSION = 3  # 2: slot views and reads per layer, typed layouts; 3: the run's meta (prompt, strategy, model)


class History(MutableSequence):
    """A generator's records, read as the list of :class:`~kvexplore.trace.records.StepRecord` it was given, with
    :meth:`save` and :meth:`save_html`; older records are kept compact (:mod:`kvexplore.trace.kept`).

    ``meta`` describes the run (what a replay or a diff needs beyond the records): ``prompt_ids``,
    ``prompt_texts``, ``kind`` (the cache strategy) and ``model`` (its name and the few figures the views draw)."""

    def __init__(self, records=(), meta: dict | None = None) -> None:
        self.meta = dict(meta if meta is not None else getattr(records, "meta", {}))
        if isinstance(records, History):  # a fork: the kept records are shared (never changed), the newest copied
            self._kept, self._recent = records._kept.copy(), list(records._recent)
            return
        self._kept, self._recent = KeptRecords(), []
        for r in records:
            self.append(r)

    def __len__(self) -> int:
        return len(self._kept) + len(self._recent)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n, k = len(self), len(self._kept)
        if not -n <= i < n:
            raise IndexError(f"record {i} of a history of {n}")
        i %= n
        return self._kept.record(i) if i < k else self._recent[i - k]

    def __iter__(self):
        for i in range(len(self._kept)):
            yield self._kept.record(i)
        yield from list(self._recent)

    def append(self, record: StepRecord) -> None:
        """Add ``record``; the one :data:`~kvexplore.trace.kept.KEEP_STEPS` records back is kept compact from now on."""
        self._recent.append(record)
        while len(self._recent) > kept.KEEP_STEPS:
            self._kept.append(self._recent.pop(0))

    def __delitem__(self, i) -> None:
        n = len(self)
        drop = range(*i.indices(n)) if isinstance(i, slice) else range(i % n, i % n + 1) if -n <= i < n else None
        if drop is None:
            raise IndexError(f"record {i} of a history of {n}")
        if drop and (drop.step == 1 and drop.stop == n or len(drop) == 1 and drop[0] == n - 1):  # the newest: a rewind
            first, k = drop[0], len(self._kept)
            del self._recent[max(0, first - k):]
            if first < k:
                self._kept.truncate(first)
        elif drop:
            gone = set(drop)
            self._keep_again(lambda old: (r for j, r in old if j not in gone))

    def __setitem__(self, i, record) -> None:
        if isinstance(i, slice):
            records = list(self)
            records[i] = record
            self._keep_again(lambda old: iter(records))
            return
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} of a history of {n}")
        self._keep_again(lambda old: (record if j == i % n else r for j, r in old))

    def insert(self, i: int, record: StepRecord) -> None:
        n = len(self)
        i = min(max(i + n if i < 0 else i, 0), n)
        self._keep_again(lambda old: (x for j, r in old for x in ((record, r) if j == i else (r,))))
        if i == n:
            self.append(record)

    def _keep_again(self, edit: Callable[[Iterator[tuple[int, StepRecord]]], Iterable[StepRecord]]) -> None:
        """Keep ``edit(enumerate(the records))`` instead (a change in the middle of the run), from the start, one
        record built at a time."""
        old = History(self)  # the kept steps are shared, never changed
        self._kept, self._recent = KeptRecords(), []
        for r in edit(enumerate(old)):
            self.append(r)

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, History)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:  # as the list's (one record built at a time)
        return "[" + ", ".join(repr(r) for r in self) + "]"

    def save(self, path: str | Path) -> Path:
        """Write the records and their traces to ``path`` (read back with :func:`kvexplore.load_trace`)."""
        return save_trace(self, path)

    def save_html(self, path: str | Path, layer: int = 0, head: int = 0, title: str | None = None,
                  picks=None) -> Path:
        """Write a self-contained HTML replay of this run (see :func:`kvexplore.replay.save_html`; ``picks``: more
        (layer, head) pairs the page can switch to)."""
        if _html_writer is None:
            import_module("kvexplore.replay")  # the drawing layer registers its writer (loaded on first use)
        if _html_writer is None:
            raise StateError("no HTML writer is registered: import kvexplore.replay first")
        return _html_writer({self.meta.get("kind", "run"): self}, path, layer=layer, head=head, title=title,
                            picks=picks)


HtmlWriter = Callable[..., Path]  # (runs: lane name -> records, path, layer=, head=, title=, picks=) -> the path
_html_writer: HtmlWriter | None = None


def register_html_writer(write: HtmlWriter) -> None:
    """Make ``write`` what :meth:`History.save_html` calls: the drawing layer sits above this one, so it registers its
    writer when imported, and :meth:`History.save_html` imports it by name on first use (docs/tracing.md)."""
    global _html_writer
    if not callable(write):
        raise TypeError(f"an HTML writer must be callable, got {type(write).__name__}")
    _html_writer = write


def save_trace(records: list[StepRecord], path: str | Path) -> Path:
    """Write ``records`` (with their traces, and the run's ``meta`` when they are a :class:`History`)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    rows = []
    outcomes: dict[int, int] = {}  # a press outcome, shared by the records until the next press, is saved once
    for i, r in enumerate(records):
        row = {f.name: getattr(r, f.name) for f in fields(r) if f.name not in ("top", "memory", "trace")}
        row["top"] = [asdict(c) for c in r.top]
        row["memory"] = None if r.memory is None else asdict(r.memory)
        row["trace"] = None if r.trace is None else _trace_row(r.trace, f"{i}", tensors)
        if r.trace is not None and r.trace.press is not None:
            row["trace"]["press"] = press_row(r.trace.press, tensors, outcomes)
        if r.trace is not None and r.trace.ranks is not None:
            row["trace"]["ranks"] = r.trace.ranks.to_dict()
        rows.append(row)
    meta = {"format": FORMAT, "version": str(VERSION), "records": json.dumps(rows),
            "run": json.dumps(getattr(records, "meta", {}))}
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)
    return path


def _trace_row(t: StepTrace, key: str, tensors: dict[str, torch.Tensor]) -> dict:
    held = [layer for layer in t.attention_layers if t.has_attention(layer)]  # an explorer keeps recent rows only
    for layer in held:
        tensors[f"{key}.attention.{layer}"] = t.attention_raw(layer).clone()
    for name, value in t.qkv.items():
        tensors[f"{key}.qkv.{name}"] = value.detach().clone()  # host copies that share a buffer: one each
    views, view_of = distinct(list(t.layer_slots))
    reads, read_of = distinct(list(t.layer_reads))
    return {"events": [asdict(e) for e in t.events],
            "views": [{**asdict(v), "layout": v.layout.to_dict()} for v in views], "view_of": list(view_of),
            "reads": [[int(p) for p in r] for r in reads], "read_of": list(read_of), "main_layer": t.main_layer,
            "gqa_groups": t.gqa_groups, "heads": t.heads,
            "attention_layers": held, "qkv": sorted(t.qkv)}


def load_trace(path: str | Path) -> History:
    """Read records written by :func:`save_trace` (no model needed), with the run's ``meta`` (empty before
    format version 3)."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"trace {path} not found; save one with history.save(path) or kvexplore generate "
                               f"--trace")
    try:
        f = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError
        raise CorruptFileError(f"{path} is not a readable kvexplore trace ({e})") from e
    meta = f.metadata() or {}
    if meta.get("format") != FORMAT:
        raise LoadError(f"{path} is not a kvexplore trace (format {meta.get('format')!r})")
    try:
        version = int(meta.get("version", 0))
    except ValueError as e:
        raise CorruptFileError(f"{path}: trace format version {meta.get('version')!r} is not a number") from e
    if version > VERSION:
        raise LoadError(f"{path} is a trace of format version {version}, newer than this kvexplore reads "
                        f"({VERSION}); upgrade kvexplore to open it")
    try:
        return History(_records(json.loads(meta["records"]), f), json.loads(meta.get("run", "{}")))
    except (KeyError, TypeError, ValueError, AttributeError, SafetensorError) as e:  # json errors are ValueErrors
        raise CorruptFileError(f"{path}: the trace's records are damaged ({type(e).__name__}: {e}); record the run "
                               f"again") from e


def _records(rows: list, f) -> list[StepRecord]:
    history = AttentionHistory()
    outcomes: dict[int, PressOutcome] = {}
    records = []
    for i, row in enumerate(rows):
        trace, memory = row.pop("trace"), row.pop("memory")
        records.append(StepRecord(
            **row | {"top": [Candidate(**c) for c in row["top"]]},
            memory=None if memory is None else _memory(memory),
            trace=None if trace is None else _trace(trace, f"{i}", f, history, outcomes)))
    return records


def _memory(row: dict) -> MemoryReport:
    layers = row.pop("layers", ())
    return MemoryReport(**row, layers=tuple(LayerMemory(**m) for m in layers) if isinstance(layers, list) else ())


def _view(row: dict) -> SlotView:
    layout = row.pop("layout", None)
    return SlotView(**row, layout=layout_from_dict(layout) if layout else LinearLayout())


def _trace(row: dict, key: str, f, history: AttentionHistory, outcomes: dict) -> StepTrace:
    if "views" in row:
        views = [_view(v) for v in row["views"]]
        layer_slots = [views[i] for i in row["view_of"]]
        layer_reads = [row["reads"][i] for i in row["read_of"]]
    else:  # version 1: one slot view and one read for every layer
        layer_slots = [] if row["slots"] is None else [_view(row["slots"])]
        layer_reads = [row["read_positions"]]
    return StepTrace(
        events=[CacheEvent(**(e | {"write": tuple(e["write"]), "read": tuple(e["read"]),
                                    "read_shape": tuple(e["read_shape"]), "stride": tuple(e["stride"])}))
                for e in row["events"]],
        layer_slots=layer_slots, layer_reads=layer_reads, main_layer=row.get("main_layer", 0),
        gqa_groups=row["gqa_groups"], heads=row["heads"],
        qkv={name: f.get_tensor(f"{key}.qkv.{name}") for name in row["qkv"]},
        _attention={layer: history.append(f.get_tensor(f"{key}.attention.{layer}"))
                    for layer in row["attention_layers"]},
        _history=history, press=press_from_row(row["press"], f, outcomes) if row.get("press") else None,
        ranks=RankStep.from_dict(row["ranks"]) if row.get("ranks") else None)
