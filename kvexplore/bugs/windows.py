"""Rings and windows: a sliding layer must hold every position its window still reads, and a ring that has wrapped
cannot give back a position it overwrote by moving a counter."""

from __future__ import annotations

from typing import Any

from ..caches.factory import make_cache
from ..caches.layers.ring import RingLayer
from ..caches.layers.sliding import SlidingLayers
from ..caches.strategies.preallocated import PreallocatedCache
from ..runtime.generator import Generator
from ..trace.tracer import Tracer
from .catalog import Bug, register
from .runs import decode_scenario, planted_maker
from .speculation import speculative_scenario

SHORT = "Once upon a time"  # shorter than the planted ring: exact until the sequence outgrows it
STEPS = 16
EARLY = 4  # how many positions too soon the planted ring evicts


class ShortRings(PreallocatedCache):
    """The planted bug: every sliding layer's ring is :data:`EARLY` slots shorter than the layer's window (evicted by
    another size than the window: a chunk), so the oldest positions the window still reads are gone."""

    def _build(self) -> None:
        super()._build()
        slots = None
        for i, spec in enumerate(self.plan):
            if spec.ring:
                slots = slots or SlidingLayers(spec.window - EARLY)
                self.layers[i] = RingLayer(spec, self.batch_size, self.dtype, self.device, slots)
        self._index()


_early = planted_maker(ShortRings, "preallocated")
_early_run, _early_check = decode_scenario(SHORT, STEPS, _early)
register(Bug(
    name="window-evicts-early", engine="SGLang (SWA chunk cache)", reference="sgl-project/sglang#8649",
    url="https://github.com/sgl-project/sglang/issues/8649", area="rings and windows",
    summary="The chunk cache evicted a sliding-window layer's tokens by the attention chunk size, not the sliding "
            "window, so tokens still inside the window were freed. Planted as rings "
            f"{EARLY} slots shorter than the window.",
    invariant="a sliding layer holds (and attention reads) exactly the last `window` positions: every position "
              "p with end - window <= p < end",
    symptom="exact while the sequence is shorter than the ring, wrong from the first step the window reaches past it",
    checker="doctor", run=_early_run, check=_early_check, model="tiny-windowed", make=_early))


class TrimmedRing(RingLayer):
    """The planted bug: a ring that wrapped says a cut is exact (as mlx's trim did: the counters move back, nothing
    is restored), so a rejected draft that overwrote a slot the kept sequence still reads stays there."""

    def _replay_error(self, n: int, length: int) -> str | None:
        return None


class TrimmedRings(PreallocatedCache):
    def _build(self) -> None:
        super()._build()
        for i, spec in enumerate(self.plan):
            if spec.ring:
                self.layers[i] = TrimmedRing(spec, self.batch_size, self.dtype, self.device, self.layers[i].slots)
        self._index()


SPEC_TEXT = "the cat sat on the mat and the cat sat on the mat and the dog sat on the log and the cat"
SPEC_STEPS = 24


def _ring_generator(model: Any, planted: bool, slots: int = 128) -> Generator:
    cache = TrimmedRings(model.config, slots, dtype=model.dtype) if planted else \
        make_cache("preallocated", model, max_seq_len=slots)
    return Generator(model, cache, draft="prompt-lookup", draft_tokens=4, tracer=Tracer())


_ring_run, _ring_check = speculative_scenario(SPEC_TEXT, SPEC_STEPS, _ring_generator)
register(Bug(
    name="ring-rollback-after-wrap", engine="mlx-swift-lm (RotatingKVCache)", reference="ml-explore/mlx-swift-lm#424",
    url="https://github.com/ml-explore/mlx-swift-lm/issues/424", area="rings and windows",
    summary="Once a sliding-window layer's ring had wrapped, trimming it for a speculative rollback only moved its "
            "counters back (or silently did nothing): the rejected drafts' keys stayed in slots the kept sequence "
            "reads. Planted as a ring that says any cut is exact.",
    invariant="after a take-back the cache reads what a cache that never saw the rejected drafts reads; a ring that "
              "wrapped over a position still in the window must restore it (or recompute), not trim",
    symptom="speculative output parts from plain greedy decoding once the sequence is longer than the window",
    checker="speculation", run=_ring_run, check=_ring_check, model="tiny-windowed",
    make=_ring_generator))
