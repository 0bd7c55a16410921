"""The undo journal of one forward pass: what a step overwrote, so a failed or rolled-back step can be put back. A layer
that overwrites held slots in place saves them first (:meth:`UndoJournal.keep`), one that writes slots never written
before asks for them to be zeroed again (:meth:`UndoJournal.zero_on_undo`), one with bookkeeping of its own registers
how to put it back (:meth:`UndoJournal.remember`); :meth:`UndoJournal.undo` replays it backwards."""

from __future__ import annotations

from typing import Any, Callable

import torch


class UndoJournal:
    """What the step under way changed. ``scratch`` (owned by the cache) holds reusable copy buffers by shape and
    dtype, so a decode step that saves what it saved last time allocates nothing; :meth:`trim` keeps only those."""

    __slots__ = ("entries", "restores", "_scratch", "_used", "_had", "q_len")

    def __init__(self, scratch: dict[tuple, list[torch.Tensor]], q_len: int = 1) -> None:
        self.entries: list[tuple[torch.Tensor, int, int, torch.Tensor | int]] = []  # slots the step overwrote
        self.restores: list[tuple[Callable[[Any], None], Any]] = []  # bookkeeping to put back
        self._scratch = scratch
        self._used: dict[tuple, int] = {}
        self._had = {key: len(pool) for key, pool in scratch.items()}  # the scratch before the step
        self.q_len = q_len  # positions the step writes

    def trim_back(self) -> None:
        """The step was rolled back: the scratch is as it was before it (buffers the step added are let go)."""
        self._keep_first(self._had)

    def kept_scratch(self) -> list[torch.Tensor]:
        """The scratch buffers :meth:`trim` will keep when the step is over."""
        if self.q_len != 1:
            return []
        return [t for key, used in self._used.items() for t in self._scratch.get(key, [])[:used]]

    def trim(self) -> None:
        """The step was settled: the scratch keeps the buffers it used only if it wrote one position (the next
        decode step needs the same), and nothing else: a prompt's or a verification's copies go with their step, a
        decode step's rare large one (a press compacting in place) with the next step."""
        self._keep_first(self._used if self.q_len == 1 else {})

    def _keep_first(self, counts: dict[tuple, int]) -> None:
        """Keep the first ``counts[key]`` buffers of each shape in the scratch, and no other."""
        scratch = self._scratch
        for key in list(scratch):
            if n := counts.get(key, 0):
                del scratch[key][n:]
            else:
                del scratch[key]

    def keep(self, t: torch.Tensor, dim: int, start: int, n: int) -> None:
        """Save ``t.narrow(dim, start, n)`` before the step overwrites it in place."""
        if n <= 0:
            return
        src = t.narrow(dim, start, n)
        key = (tuple(src.shape), src.dtype)
        used = self._used.get(key, 0)
        pool = self._scratch.setdefault(key, [])
        if used == len(pool):
            pool.append(torch.empty_like(src, memory_format=torch.contiguous_format))
        self._used[key] = used + 1
        saved = pool[used]
        saved.copy_(src)
        self.entries.append((t, dim, start, saved))

    def zero_on_undo(self, t: torch.Tensor, dim: int, start: int, n: int) -> None:
        """The step writes ``t.narrow(dim, start, n)``, never written before (zeros): an undo zeroes it again."""
        if n > 0:
            self.entries.append((t, dim, start, n))

    def keep_at(self, t: torch.Tensor, dim: int, index: torch.Tensor) -> None:
        """Save ``t.gather(dim, index)`` before the step scatters into those places in place."""
        self.entries.append((t, dim, index, t.gather(dim, index)))

    def remember(self, restore: Callable[[Any], None], saved: Any) -> None:
        """An undo calls ``restore(saved)`` (after the tensors are back), latest first."""
        self.restores.append((restore, saved))

    def undo(self) -> None:
        """Put back everything recorded, newest first."""
        for t, dim, start, saved in reversed(self.entries):
            if isinstance(start, torch.Tensor):  # saved by keep_at: put back where it was gathered
                t.scatter_(dim, start, saved)
            elif isinstance(saved, int):
                t.narrow(dim, start, saved).zero_()
            else:
                t.narrow(dim, start, saved.shape[dim]).copy_(saved)
        for restore, saved in reversed(self.restores):
            restore(saved)
        self.entries, self.restores = [], []


class NoJournal(UndoJournal):
    """A step that keeps no undo (a write without ``begin_step``): every record is dropped."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__({})

    def _drop(self, *record: Any) -> None:
        pass

    keep = zero_on_undo = keep_at = remember = _drop
