"""The ranks' part of one step of a lane run over several processes (an explorer lane ``tp:N`` or ``cp:N``,
:mod:`kvexplore.distributed.lead`): what each rank holds after the step's pass and what its collectives carried in it.
Kept on the step's trace (:attr:`~.tracer.StepTrace.ranks`), so the explorer and the HTML replay draw the ranks from
the records alone, and saved with them."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class RankShare:
    """One rank after a pass: what it holds (``kv_heads`` under tensor parallelism; its positions follow from the
    step's layout under context parallelism), its cache's bytes, and its collectives in the pass."""

    rank: int
    describe: str  # "rank 1 of 3: q heads 3..5, KV heads 1..1" (the split's or the layout's words)
    held_bytes: int
    kv_heads: tuple[int, ...] | None = None
    replicas: int = 1  # how many ranks hold each of its KV heads
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True)
class RankStep:
    """Every rank after one pass. ``position`` and ``tokens``: where the pass started and how many it fed;
    ``seconds``: the pass as the leading process waited for it (every rank's part and the pipes included)."""

    mode: str  # "tp" (tensor parallel) or "cp" (context parallel)
    what: str  # the split in words ("tensor parallel")
    collective: str  # what its collectives are ("all-reduces")
    position: int
    tokens: int
    seconds: float
    length: int  # positions the caches hold after the pass
    shares: tuple[RankShare, ...]
    model_kv_heads: int | None = None  # tensor parallel: the model's KV heads
    interleave: int = 1  # context parallel: positions in runs of this many per rank

    @property
    def traffic(self) -> tuple[RankShare, ...]:
        """Each rank's collectives in the pass (``calls``, ``bytes``, ``seconds``), as ``Ranks.steps`` gives them."""
        return self.shares

    @property
    def whole_bytes(self) -> int:
        """One process's cache of the same strategy and length: the ranks' bytes summed, a replicated KV head once."""
        return sum(s.held_bytes for s in self.shares) // max(1, self.shares[0].replicas)

    def positions(self, rank: int) -> list[int]:
        """The positions rank ``rank`` holds (context parallel: ``(p // interleave) % ranks == rank``; tensor
        parallel: every position)."""
        if self.mode != "cp":
            return list(range(self.length))
        n = len(self.shares)
        return [p for p in range(self.length) if (p // self.interleave) % n == rank]

    def memory(self) -> list[dict[str, Any]]:
        """Each rank as ``Ranks.memory()`` describes it (what :func:`kvexplore.views.ranks.rank_map` draws)."""
        tp = self.mode != "cp"
        return [{"rank": s.rank, "describe": s.describe, "held_bytes": s.held_bytes, "replicas": s.replicas,
                 "kv_heads": list(s.kv_heads) if tp and s.kv_heads is not None else None,
                 "model_kv_heads": self.model_kv_heads if tp else None,
                 "positions": None if tp else self.positions(s.rank), "length": self.length} for s in self.shares]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> "RankStep":
        shares = tuple(RankShare(**{**s, "kv_heads": None if s["kv_heads"] is None else tuple(s["kv_heads"])})
                       for s in row["shares"])
        return cls(**{**row, "shares": shares})
