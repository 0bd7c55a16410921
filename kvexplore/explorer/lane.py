"""One strategy's lane of an explorer :class:`~.session.Session`: its generator and tracer, and how it compares with
the session's reference lane step by step (KL divergence, top-1 agreement, where it first parts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CacheFullError, RankError
from ..runtime.generator import Generator
from ..trace.records import StepRecord
from ..views.divergence import first_divergence
from .lanes import GIVEN, LaneKind, find
from .probe import LaneTracer


@dataclass
class Lane:
    """One strategy's generator in a session. ``kind`` is its strategy's name (what the views label it with);
    ``fork_of`` the name of the lane it was forked from (None for a lane the session started itself: forks end with
    the sequence they forked from)."""

    name: str
    kind: str
    generator: Generator
    tracer: LaneTracer
    follows: bool  # fed the reference lane's tokens
    kl_at: dict[int, float | None] = field(default_factory=dict)  # step -> KL(reference || this lane)
    top1_at: dict[int, bool] = field(default_factory=dict)  # step -> own top-1 == the reference's top-1
    forced_at: set[int] = field(default_factory=set)  # steps whose token was the reference's, not its own choice
    fork_of: str | None = None
    checkups: dict[int, Any] = field(default_factory=dict)  # verification -> the doctor's check after it (.checkup)
    shared_pass: str | None = None  # the lane whose prefill pass this lane reused (.shared_pass), if any
    full: CacheFullError | None = None  # why the steps go on without this lane (its cache is full), until a rewind
    stopped: RankError | None = None  # why the steps go on without this lane (a rank of it stopped), until a reset

    @property
    def lane_kind(self) -> LaneKind:
        """The kind of lane its strategy is (:mod:`.lanes`; a given generator's unknown strategy: :data:`GIVEN`)."""
        return find(self.kind) or GIVEN

    @property
    def is_fork(self) -> bool:
        return self.fork_of is not None

    def forget_after(self, steps: int) -> None:
        """Drop the comparison figures of steps ``steps`` and later (after a rewind)."""
        for d in (self.kl_at, self.top1_at):
            for k in [k for k in d if k >= steps]:
                del d[k]
        self.forced_at = {k for k in self.forced_at if k < steps}
        kept = len(self.speculation.verifications) if self.speculation is not None else 0
        self.checkups = {i: c for i, c in self.checkups.items() if i < kept}

    cache = property(lambda self: self.generator.cache)
    history = property(lambda self: self.generator.history)  # the lane's records (a History)
    speculation = property(lambda self: self.generator.speculation)  # its drafting counts (None: it does not draft)

    @property
    def kl(self) -> list[float | None]:
        """Per record: KL divergence of this lane's next-token distribution from the reference's (None: reference)."""
        return [self.kl_at.get(r.step) for r in self.history]

    @property
    def top1(self) -> list[bool | None]:
        """Per record: whether this lane's most likely token is the reference's."""
        return [self.top1_at.get(r.step) for r in self.history]

    @property
    def divergence(self) -> tuple[int, int] | None:
        """(step, position of its pass) where this lane first parts from the reference (None: it has not)."""
        return first_divergence(self.history, self.kl, self.top1)

    @property
    def last(self) -> StepRecord | None:
        return self.generator.history[-1] if self.generator.history else None
