"""A cache's step, from begin to end: :meth:`StepCycle.begin_step` plans it in every layer and opens its undo journal;
the layers write (:meth:`~kvexplore.caches.base.KVCache.write`, through :meth:`StepCycle._step_for`); then
:meth:`StepCycle.settle` forgets how to undo it (freeing what the journal kept alive) or :meth:`StepCycle.rollback`
puts back everything it changed (length, slots, memory report, held keys and values).
"""

from __future__ import annotations

from ..core.allocator import Window
from .journal import UndoJournal
from .layer import Step


class StepCycle:
    """The step's life of a model-level cache (mixed into :class:`~kvexplore.caches.base.KVCache`)."""

    def begin_step(self, pos: int = 0, q_len: int = 0) -> None:
        """Start a forward pass writing ``q_len`` positions at ``pos`` (after ``check_write`` passed): plan it in
        every layer now, count its writes, copies and allocations, and open the journal :meth:`rollback` undoes."""
        self._saved = (self._length, self._counters, self._report, self._window, self._layer_moved,
                       self._sparse_reads)
        self._journal = UndoJournal(self._scratch, q_len)
        self._start(pos, q_len, self._journal)
        self._window = Window(self.allocator)

    def _start(self, pos: int, q_len: int, journal: UndoJournal | None) -> Step:
        step = self._cur = Step(pos, q_len, self._length, self.device, journal)
        self._counters = step.counters
        self._layer_moved, self._masks, self._sparse_reads = {}, {}, {}
        for layer in self._planners:
            layer.begin(step)
        return step

    def _step_for(self, pos: int, q_len: int) -> Step:
        """The step under way, or one started now for a write without ``begin_step`` (no undo is kept)."""
        step = self._cur
        if step is None or step.committed:
            return self._start(pos, q_len, None)
        if step.pos != pos or step.q_len != q_len:  # the layers write another span than planned: plan it again
            step.pos, step.q_len, step.end = pos, q_len, pos + q_len
            self._masks = {}
            for layer in self._planners:
                layer.begin(step)
        return step

    @property
    def _undo(self) -> UndoJournal | None:
        """The journal of the step :meth:`rollback` would undo (None: nothing to undo)."""
        return self._journal

    @property
    def _undo_data(self) -> list:
        """The slots the step to undo overwrote, as the journal keeps them."""
        return [] if self._journal is None else self._journal.entries

    def settle(self) -> None:
        """Forget how to undo the last step: from here on :meth:`rollback` does nothing until a step begins. What
        the journal kept alive is freed now (a concatenating cache's old storage): the step's report counts it."""
        journal = self._journal
        window = Window(self.allocator if journal is not None else None)
        with window:
            self._journal, self._saved, self._cur = None, None, None  # the step held the journal and its reads
            self._masks = {}  # and its masks (read by its forward pass only)
            if had_step := journal is not None:
                journal.trim()
                del journal
        if self._report is not None:
            for name, n in window.figures().items():
                self._report.cuda[name] = self._report.cuda.get(name, 0) + n
        if had_step:
            self._held_again()

    def rollback(self) -> None:
        """Undo the last step (written or committed) exactly: length, slots, memory report, held keys and values.
        Does nothing when there is no step to undo (none began, or it was already rolled back)."""
        if self._journal is None:
            return
        self._journal.undo()
        self._journal.trim_back()
        (self._length, self._counters, self._report, self._window, self._layer_moved,
         self._sparse_reads) = self._saved
        self._journal, self._saved, self._cur, self._masks = None, None, None, {}
        self._held_again(walk=True)
