"""Taking a step's last positions back: what speculative decoding asks of a cache after the target rejected drafts.

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


class Crop:
    """The take-back questions of a model-level cache (mixed into :class:`~kvexplore.caches.base.KVCache`)."""

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
