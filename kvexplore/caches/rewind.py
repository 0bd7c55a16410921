"""Going back: a rewind to ``n`` positions (:meth:`Rewind.truncate`, checked first by :meth:`Rewind.check_truncate`;
where only rings or recurrent states stop it, the generator recomputes: :meth:`Rewind.needs_replay`), and taking a
step's last positions back, what speculative decoding asks of a cache after the target rejected drafts.

A verification pass writes the newest token and ``k`` drafted ones; only the accepted prefix stays. Each layer says
whether cutting the step back (:meth:`~kvexplore.caches.layer.LayerCache.truncate`) leaves it exactly as a step that
wrote only the kept positions would (:meth:`~kvexplore.caches.layer.LayerCache.crop_error`), and in words how the cut
looks in it (``crop_way``). Where any layer objects (a ring the draft wrapped over positions still read, a sink
window that evicted, a quantized flush, a recurrent state), the whole step is rolled back from its undo journal and
the accepted tokens are written again (the generator does it: :mod:`kvexplore.runtime.speculative`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import SettingsError
from .memory import StepCounters


class Rewind:
    """Rewinds and the take-back questions of a model-level cache (mixed into
    :class:`~kvexplore.caches.base.KVCache`)."""

    #: True inside :meth:`checkpointing_states` (a verification pass): linear-attention layers then compute token by
    #: token and hand the state after each position to the cache (``write_state(..., checkpoints=)``), so a cut
    #: restores one of them instead of recomputing the accepted tokens
    checkpointing = False

    @contextmanager
    def checkpointing_states(self) -> Iterator[None]:
        """Inside: :attr:`checkpointing` (the states after each position are kept); after: as before."""
        before, self.checkpointing = self.checkpointing, True
        try:
            yield
        finally:
            self.checkpointing = before

    def crop_error(self, n: int) -> str | None:
        """Why cutting the step just written back to ``n`` positions would not leave the cache as a step that wrote
        only up to ``n`` would (None: ``truncate(n)`` does); names the first layer that objects."""
        if not 0 <= n <= self.length:
            return f"cannot cut to {n}: the cache holds {self.length} positions"
        for spec, layer in zip(self.plan, self.layers):
            if msg := layer.crop_error(n, self.length):
                return f"layer {spec.index} ({spec.kind}): {msg}"
        return None

    def crop_ways(self) -> dict[str, str]:
        """How a take-back looks in each kind of layer this cache has: the layer class's name -> the way, in words."""
        return {type(layer).__name__: layer.crop_way for layer in self.layers}

    def speculation_refusal(self) -> str | None:
        """Why a drafting generator cannot run on this cache (None: it can)."""
        return None

    # -- rewinds ----------------------------------------------------------------------------------------------
    def _recompute_error(self, n: int) -> str | None:
        """Why some layer (a ring, a recurrent state) cannot go back to ``n`` positions although recomputing would
        rebuild it (None: every layer can); the generator then recomputes instead (:meth:`needs_replay`)."""
        for layer in self.layers:
            if msg := layer.replay_error(n, self.length):
                return msg
        return None

    def check_truncate(self, n: int, rings: bool = True) -> None:
        """Raise, changing nothing, if the cache cannot be truncated to ``n`` positions (so several caches can be
        checked before any is rewound). ``rings=False``: check only what the strategy itself allows."""
        if not 0 <= n <= self.length:
            raise SettingsError(f"cannot truncate to {n}: the cache holds {self.length} positions "
                                f"(0 <= n <= {self.length})")
        if rings and (msg := self._recompute_error(n)):
            raise SettingsError(f"cannot truncate to {n}: {msg}")
        for layer in self.layers:
            if msg := layer.truncate_error(n, self.length):
                raise SettingsError(msg)

    def needs_replay(self, n: int) -> bool:
        """True when only the sliding layers' rings or the linear-attention states stop a truncate to ``n``: going
        back means recomputing the sequence's first ``n`` positions (what :meth:`kvexplore.Generator.rewind` does)."""
        if not 0 <= n <= self.length or self._recompute_error(n) is None:
            return False
        try:
            self.check_truncate(n, rings=False)
        except SettingsError:
            return False
        return True

    def truncate(self, n: int) -> None:
        """Rewind: keep only the first ``n`` positions. Storage is not cleared; the length moves back."""
        self.check_truncate(n)
        length = self._length
        self._length = n
        self._counters = StepCounters()
        self._layer_moved, self._sparse_reads, self._masks = {}, {}, {}
        for layer in self.layers:
            layer.truncate(n, length, self._counters)
        self._report = None
        self._journal, self._saved, self._cur = None, None, None
