"""What one generation step produced: the record widgets and the CLI read."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..caches.memory import MemoryReport
from .later import built_later
from .tracer import StepTrace


@dataclass(frozen=True, slots=True)
class Candidate:
    """One of the most likely next tokens, under the model's unfiltered distribution."""

    token_id: int
    text: str
    prob: float


#: a record's ``kind`` (its phase) -> whether it is a prefill: the one place the phase names are read
_PREFILL = {"prefill": True, "decode": False}


@built_later("top", "memory", "trace")
@dataclass
class StepRecord:
    """One new token. ``position`` is where the token sits in the sequence (the *next* forward pass writes it to the
    cache); ``input_len`` is how many tokens this step's forward pass fed (the prompt at prefill, 1 per decode step
    with a cache, the whole sequence without one)."""

    step: int  # 0 for the token chosen after prefill, then 1, 2, ...
    kind: str  # "prefill" or "decode"
    token_id: int
    text: str
    position: int
    input_len: int
    cache_length: int  # positions held by the cache after this step's forward pass
    prob: float  # probability of the chosen token under the unfiltered distribution
    top: list[Candidate] = field(default_factory=list)
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
