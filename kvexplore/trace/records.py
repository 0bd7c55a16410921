"""What one generation step produced: the record widgets and the CLI read."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from ..caches.memory import MemoryReport
from .tracer import StepTrace


@dataclass(frozen=True, slots=True)
class Candidate:
    """One of the most likely next tokens, under the model's unfiltered distribution."""

    token_id: int
    text: str
    prob: float


class PackedCandidates:
    """A record's candidates packed: their ids and probabilities in one bytes object (int32 and float64: exact), their
    texts shared; a sequence of :class:`Candidate` (built when read) equal to the list it was made from. The history
    packs the records older than the newest few this way (a long run's records hold about half the bytes)."""

    __slots__ = ("_raw", "_texts")
    _ROW = struct.Struct("<id")

    def __init__(self, top) -> None:
        self._raw = b"".join(self._ROW.pack(c.token_id, c.prob) for c in top)
        self._texts = tuple(c.text for c in top)

    def __len__(self) -> int:
        return len(self._texts)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._texts)
        if not -n <= i < n:
            raise IndexError("candidate index out of range")
        i %= n
        token, prob = self._ROW.unpack_from(self._raw, i * self._ROW.size)
        return Candidate(token, self._texts[i], prob)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        if isinstance(other, (list, tuple, PackedCandidates)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return repr(list(self))


#: a record's ``kind`` (its phase) -> whether it is a prefill: the one place the phase names are read
_PREFILL = {"prefill": True, "decode": False}


@dataclass(slots=True)
class StepRecord:
    """One new token.

    ``position`` is where the token sits in the sequence (it is written to the cache by the *next* forward
    pass); ``input_len`` is how many tokens this step's forward pass fed (the whole prompt at prefill, 1 per
    decode step with a cache, the whole sequence without one).
    """

    step: int  # 0 for the token chosen after prefill, then 1, 2, ...
    kind: str  # "prefill" or "decode"
    token_id: int
    text: str
    position: int
    input_len: int
    cache_length: int  # positions held by the cache after this step's forward pass
    prob: float  # probability of the chosen token under the unfiltered distribution
    top: list[Candidate] | PackedCandidates = field(default_factory=list)
    forward_s: float = 0.0
    sample_s: float = 0.0
    is_eos: bool = False
    memory: MemoryReport | None = None  # the cache's memory after this step's forward pass
    trace: StepTrace | None = None  # what a Tracer recorded (None without one)
    draft_token: int | None = None  # speculative decoding: what the drafter proposed at this position (None: nothing)
    verification: int | None = None  # the verification pass that gave this token (None: a plain step)

    @property
    def drafted(self) -> bool:
        """A drafter proposed a token at this position (it became this token if :attr:`accepted`)."""
        return self.draft_token is not None

    @property
    def accepted(self) -> bool:
        """This token was drafted and the target accepted it (False for a correction, a bonus or a plain step)."""
        return self.draft_token is not None and self.draft_token == self.token_id

    @property
    def is_prefill(self) -> bool:
        """The record of a prefill (the prompt's forward pass), not of a decode step."""
        return _PREFILL[self.kind]

    @property
    def is_decode(self) -> bool:
        """The record of one decode step (one token fed, with a cache)."""
        return not _PREFILL[self.kind]

    @property
    def elapsed_s(self) -> float:
        return self.forward_s + self.sample_s
