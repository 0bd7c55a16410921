"""A cache's bookkeeping of its step (``cache.book``): what the container writes as a forward pass goes, and what its
inspector and its memory report read (:mod:`kvexplore.caches.inspector`)."""

from __future__ import annotations

import torch

from ..core.allocator import Window
from .journal import UndoJournal
from .layer import Step
from .memory import MemoryReport, StepCounters


class StepBook:
    """The last step of a cache, as its container keeps it: ``counters`` (its bytes and allocations), ``moved`` (layer
    -> bytes written and copied), ``reads`` (layer -> the positions a sparse attention read), ``window`` (the
    allocator's counters over its writes), ``report`` (the memory report made when it committed; None: made on first
    request); while it is under way or can be undone: ``step``, ``journal`` (how to undo it), ``saved`` (the container's
    figures before it) and ``masks`` (one per mask group); ``scratch``: the journals' reused copy buffers."""

    __slots__ = ("counters", "moved", "reads", "window", "report", "step", "journal", "saved", "masks", "scratch")

    def __init__(self) -> None:
        self.counters = StepCounters()
        self.moved: dict[int, tuple[int, int]] = {}
        self.reads: dict[int, list[int] | torch.Tensor] = {}
        self.window = Window(None)
        self.report: MemoryReport | None = None
        self.step: Step | None = None
        self.journal: UndoJournal | None = None
        self.saved: tuple | None = None
        self.masks: dict[tuple, torch.Tensor | None] = {}
        self.scratch: dict[tuple, list[torch.Tensor]] = {}

    def figures(self) -> tuple:
        """What :meth:`restore` puts back: the figures of the last committed step."""
        return self.counters, self.report, self.window, self.moved, self.reads

    def restore(self, figures: tuple) -> None:
        self.counters, self.report, self.window, self.moved, self.reads = figures

    def forget_step(self) -> None:
        """The step can no longer be undone: its journal, its saved figures and its masks go."""
        self.journal, self.saved, self.step, self.masks = None, None, None, {}

    def twin(self) -> "StepBook":
        """The book of a copy of the cache: the same figures, no step under way, buffers of its own."""
        twin = StepBook()
        twin.restore(self.figures())
        return twin
