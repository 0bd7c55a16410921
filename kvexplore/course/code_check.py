"""Code exercises, checked generically: the student's class serves some layers (or the page table) of a cache, the
model runs through the doctor (every cached step against a recomputation without a cache), optionally through a fork
(two sequences sharing a prefix, each step against its own recomputation), and when it is wrong the exercise's probes
look into the student's code and buffers for a hint in a student's words.

An exercise declares how, in its notebook's module of :mod:`kvexplore.course.solutions`: ``CODE[id]`` a
:class:`CodeExercise` (the class to subclass, the model, how to build the cache from the student's class, the probes).
The bases a student subclasses for 05.2 and 08.1 live here (:class:`PageTableExercise`, :class:`RingLayerExercise`):
each is the package's own class with the part the exercise asks for left to write."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..caches.layer import shallow_copy
from ..caches.layers.paged_layer import PageTable
from ..caches.layers.ring import RingLayer
from ..core import host
from ..errors import SettingsError
from .verdict import Verdict

Probe = Callable[[Any, type], str]  # (model, the student's class) -> "Hint: ..." or "" (nothing to say)


@dataclass(frozen=True)
class ForkCheck:
    """A prefix prefilled, the cache forked, then ``first[i]`` and ``second[i]`` written in turn by the two
    sequences; each step's logits are compared with a recomputation of that sequence without a cache."""

    prompt: list[int]
    first: list[int]
    second: list[int]


@dataclass(frozen=True)
class CodeExercise:
    base: type                       # the class a student subclasses
    task: str                        # what the subclass writes, as the refusal of another answer says it
    model: Callable[[], Any]         # the (small) model it runs on
    cache: Callable[[Any, type], Any]  # (model, the student's class) -> a fresh KVCache whose layers use it
    prompt: list[int]
    steps: int = 6
    model_name: str = "the tiny model"
    probes: tuple[Probe, ...] = ()   # asked in turn when it is wrong: the first hint wins
    watch: Callable[[type], tuple[type, Callable[[], str]]] | None = None  # cls -> (class to run, hint from a run)
    fallback: str = ""               # the hint when no probe says anything
    probe_on_error: bool = True      # ask the probes when the student's code raised
    fork: ForkCheck | None = None    # also run a fork: a write into a page both sequences hold is caught there
    audit: bool = False              # ask the probes even when every output is right (bookkeeping mistakes)


def exercise_of(exercise: str) -> CodeExercise:
    from . import solutions

    return solutions.module(exercise).CODE[exercise]


def check_code(exercise: str, cls) -> Verdict:
    """``cls`` (the student's class) through ``exercise``'s doctor run, fork and probes."""
    spec = exercise_of(exercise)
    base = spec.base
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise SettingsError(f"{exercise} takes your class, a subclass of {base.__name__} (from {base.__module__} "
                            f"import {base.__name__}) {spec.task}; got {cls!r}")
    from ..diagnosis.run import doctor

    model = spec.model()
    run_cls, seen = spec.watch(cls) if spec.watch is not None else (cls, lambda: "")
    try:
        report = doctor(model, prompt=spec.prompt, steps=spec.steps, cache=spec.cache(model, run_cls))
    except Exception as e:  # the student's code (or attention over what it returned) raised: say what, and why
        if isinstance(e, SettingsError):
            if e.__cause__ is None:  # a refusal of the settings, not the student's code
                raise
            e = e.__cause__  # the doctor says the cached pass failed: the student's code raised this
        if isinstance(e, NotImplementedError):
            return Verdict(exercise, False, f"your {_what(base)} is not written yet: {e}.")
        hint = seen() or (_hint(spec, model, cls) if spec.probe_on_error else "")
        return Verdict(exercise, False, f"running {spec.model_name} with your {_what(base)} raised "
                                        f"{type(e).__name__}: {str(e).rstrip('.')}." + (f" {hint}" if hint else ""))
    if report.diverged:
        verb = "differ" if report.what.endswith("s") else "differs"
        where = (f"at step {report.step} (position {report.position}), layer {report.layer}: the {report.what} "
                 f"{verb} from a recomputation without a cache (by up to {report.max_diff:.3g})")
        return Verdict(exercise, False, f"{where}. {_hint(spec, model, cls) or seen() or spec.fallback}")
    if spec.fork is not None:
        try:
            parted = fork_check(model, lambda: spec.cache(model, cls), spec.fork)
        except SettingsError:
            raise
        except Exception as e:
            hint = _hint(spec, model, cls)
            return Verdict(exercise, False, f"after a fork, your {_what(base)} raised {type(e).__name__}: "
                                            f"{str(e).rstrip('.')}." + (f" {hint}" if hint else ""))
        if parted:
            return Verdict(exercise, False, f"{parted}. {_hint(spec, model, cls) or spec.fallback}")
    if spec.audit and (hint := _hint(spec, model, cls)):
        return Verdict(exercise, False, f"every output is right, yet the bookkeeping is not. {hint}")
    both = ", and in both sequences of a fork" if spec.fork is not None else ""
    return Verdict(exercise, True, f"your {_what(base)} gives what a recomputation without a cache gives, at every "
                                   f"one of {report.steps} steps and every layer of {spec.model_name}{both}")


def _what(base: type) -> str:
    return "layer" if "Layer" in base.__name__ else "page table" if "PageTable" in base.__name__ else "class"


def _hint(spec: CodeExercise, model, cls) -> str:
    for probe in spec.probes:
        try:
            hint = probe(model, cls)
        except Exception as e:  # a probe that cannot even run the student's code says so
            hint = f"Hint: your code raised {type(e).__name__} when asked directly: {e}."
        if hint:
            return hint
    return ""


def fork_check(model, make, fork: ForkCheck, tolerance: float = 1e-4) -> str:
    """Where the two sequences of a fork first part from their recomputations ("" when they never do)."""
    from ..caches.factory import make_cache

    cache = make()
    with torch.no_grad():
        model(torch.tensor([fork.prompt]), cache, 0)
        twin = cache.fork()
        runs = [("first", cache, list(fork.prompt), fork.first), ("second", twin, list(fork.prompt), fork.second)]
        for i in range(len(fork.first)):
            for name, c, seq, tokens in runs:
                pos = len(seq)
                seq.append(tokens[i])
                got = model(torch.tensor([[tokens[i]]]), c, pos, last_only=True)[0, -1]
                ref = model(torch.tensor([seq]), make_cache("concat", model), 0, last_only=True)[0, -1]
                diff = float((got - ref).abs().max())
                if diff > tolerance * max(float(ref.abs().max()), 1.0):
                    return (f"after a fork of a {len(fork.prompt)}-token prefix, the {name} sequence's step at "
                            f"position {pos} differs from a recomputation without a cache (by up to {diff:.3g}): "
                            f"what one sequence wrote changed what the other reads")
    return ""


class RingLayerExercise(RingLayer):
    """A sliding layer's ring of ``window`` slots with two methods left to write: :meth:`slot` (where a position is
    written) and :meth:`reads` (which slots a query reads from the ring). A step first gathers the ring as it was
    (every slot), appends the new keys, and masks each query to what :meth:`reads` names plus the new keys in its
    window; then it writes the step's last ``window`` positions to their slots."""

    @property
    def window(self) -> int:
        return self.slots.window

    def slot(self, p: int) -> int:
        """The slot position ``p`` is written to (0 .. window - 1)."""
        raise NotImplementedError("write slot(p): the slot of the ring that position p is written to")

    def reads(self, q: int, pos: int) -> list[int]:
        """The slots a query at position ``q`` reads from the ring, in a step whose first new position is ``pos``
        (positions before ``pos`` are in the ring; ``pos`` .. ``q`` are the step's new keys)."""
        raise NotImplementedError("write reads(q, pos): the slots a query at position q reads from the ring")

    _columns: tuple[int, torch.Tensor, list[int]] | None = None  # (step serial, mask, position of each key column)

    def write(self, step, k, v):
        self.slots.begin(step)
        W, pos, end = self.window, step.pos, step.end
        held = list(self.slots.slot_pos)  # what each slot holds before this step, where a correct ring puts it
        mask = torch.zeros((end - pos, W + end - pos), dtype=torch.bool)
        for i, q in enumerate(range(pos, end)):
            for s in self.reads(q, pos):
                if not 0 <= s < W:
                    raise IndexError(f"reads({q}, {pos}) names slot {s}, outside the ring's {W} slots (0..{W - 1})")
                mask[i, s] = True
            for j, p in enumerate(range(pos, end)):
                mask[i, W + j] = q - W < p <= q
        self._columns = (step.serial, mask.to(k.device), held + list(range(pos, end)))
        out = torch.cat([self.k, k.to(self.k.dtype)], 2), torch.cat([self.v, v.to(self.v.dtype)], 2)
        step.counters.temporaries(self.k.nbytes + self.v.nbytes, copied=self.k.nbytes + self.v.nbytes)
        for p in range(max(pos, end - W), end):
            s = self.slot(p)
            if not 0 <= s < W:
                raise IndexError(f"slot({p}) is {s}, outside the ring's {W} slots (0..{W - 1})")
            for t, new in ((self.k, k), (self.v, v)):
                step.journal.keep(t, 2, s, 1)
                t.narrow(2, s, 1).copy_(new.narrow(2, p - pos, 1))
                step.counters.written_bytes += new.narrow(2, p - pos, 1).nbytes
        return out

    def mask(self, step):
        return self._columns[1] if self._columns is not None and self._columns[0] == step.serial else None

    def _read_positions(self, length: int) -> list[int]:
        return list(self._columns[2]) if self._columns is not None else super()._read_positions(length)


def ring_cache(cache_cls: type, layer_cls: type) -> type:
    """``cache_cls`` (a strategy) whose sliding layers' rings are ``layer_cls``."""

    class StudentRings(cache_cls):
        kind = f"student:{layer_cls.__name__}"

        def _build(self):
            super()._build()
            self.layers = [shallow_copy(l, layer_cls) if type(l) is RingLayer else l for l in self.layers]
            self._index()

    return StudentRings


class PageTableExercise(PageTable):
    """The paged cache's block tables with :meth:`make_room` left to write: before a write of ``pos .. pos + q_len -
    1``, make the sequence's last page its own if another sequence also holds it and the write continues it (copy-on-
    write), and give every block the write reaches a page. Helpers: :meth:`take` (a page from the free list),
    :meth:`copy_page`, ``self.pool.refcount[page]`` (how many block tables hold it), ``self.pool.release(page)``
    (drop one reference; the page is free when none is left), ``self.block_size``."""

    _counters = None
    _journal = None

    def make_room(self, table: list[int], pos: int, q_len: int) -> None:
        """``table``: one sequence's pages (block ``i`` holds positions ``i * block_size ..``), already cut to the
        blocks before ``pos``; change it in place."""
        raise NotImplementedError("write make_room(table, pos, q_len): copy a shared page before writing into it, "
                                  "and take a page for each new block")

    def take(self) -> int:
        """A page from the free list (held by one table: this one)."""
        if self._counters is not None:
            self._counters.allocations += 1
            self._counters.allocated_bytes += self.page_bytes
        return self.pool.take()

    def copy_page(self, old: int, new: int, slots: int) -> None:
        """Copy the first ``slots`` slots of page ``old`` into page ``new``, in every layer."""
        for t in self.pool.tensors():
            if self._journal is not None:
                self._journal.keep(t, 0, new, 1)  # the free page as it was, for a rollback
            t[new, :, :slots].copy_(t[old, :, :slots])
            if self._counters is not None:
                self._counters.copied_bytes += t[old, :, :slots].nbytes
        self.pool.written[new] = slots

    def plan(self, step) -> None:
        pos, q_len = step.pos, step.q_len
        if self._step == step.serial and self.prepared == (pos, q_len):
            return
        pool = self.pool
        if self._step != step.serial:
            step.journal.remember(self._restore, (self.copies(), list(pool.refcount), list(pool.written),
                                                  list(pool.free)))
        self._step = step.serial
        bs, keep = self.block_size, math.ceil(pos / self.block_size)
        self.drop_blocks(keep, step.counters)
        self._counters, self._journal = step.counters, step.journal
        try:
            for table in self.tables:
                self.make_room(table, pos, q_len)
                if len(table) < math.ceil((pos + q_len) / bs):
                    raise IndexError(f"block {len(table)} (positions {len(table) * bs}..{(len(table) + 1) * bs - 1}) "
                                     f"has no page in the block table after make_room({pos}, {q_len})")
                for p in range(pos, pos + q_len):
                    page = table[p // bs]
                    pool.written[page] = max(pool.written[page], p % bs + 1)
        finally:
            self._counters = self._journal = None
        self.pages_written = sorted({t[p // bs] for t in self.tables for p in range(pos, pos + q_len)})
        self.read_idx = host.upload(self.tables, self.device, torch.long)
        p = torch.arange(pos, pos + q_len, device=self.device)
        self.write_page = self.read_idx[:, p // bs]
        self.write_slot = (p % bs).expand(self.batch_size, q_len)
        self.prepared = (pos, q_len)

    def fork(self) -> "PageTableExercise":
        twin = super().fork()
        twin.__class__ = type(self)
        return twin

    def clone(self) -> "PageTableExercise":
        twin = super().clone()
        twin.__class__ = type(self)
        return twin


def paged_cache(table_cls: type) -> type:
    """The paged strategy whose block tables are ``table_cls``."""
    from ..caches.strategies.paged import PagedCache

    class StudentPaged(PagedCache):
        kind = f"student:{table_cls.__name__}"

        def _index(self):  # a fork's table is made by PageTable.fork: it is the student's class again
            super()._index()
            if type(self.table) is not table_cls:
                self.table.__class__ = table_cls

    return StudentPaged
