"""What serving one request gives back: the tokens, how many prompt tokens came from the cache and how many were
computed, the bytes it shared, and each stretch of recomputed tokens with its reason in words."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .frames import MISS_KINDS


def count(n: int, what: str) -> str:
    """``1 token``, ``2 tokens``, ``2 batches``."""
    return f"{n} {what}{'' if n == 1 else 'es' if what.endswith('ch') else 's'}"


@dataclass(frozen=True)
class Miss:
    """Prompt positions ``start .. end - 1`` were computed, not taken from the cache, because of ``kind`` (a key of
    :data:`~kvexplore.prefix.frames.MISS_KINDS`); ``reason`` says it with the tokens and requests involved."""

    kind: str
    start: int
    end: int
    reason: str
    request: int | None = None  # the earlier request the reason refers to (None: none)

    def __post_init__(self) -> None:
        if self.kind not in MISS_KINDS:
            raise ValueError(f"unknown miss kind {self.kind!r}; one of {sorted(MISS_KINDS)}")

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"positions {self.start}..{self.end - 1} ({count(self.tokens, 'token')}): {self.reason}"


@dataclass
class ServeResult:
    """One request served by a :class:`~kvexplore.PrefixPool`: ``hit_tokens`` read from shared blocks plus
    ``recomputed_tokens`` computed make the prompt; ``misses`` explain every recomputed position."""

    index: int
    label: str
    prompt: list[int]
    generated: list[int]
    hit_tokens: int
    recomputed_tokens: int
    misses: list[Miss]
    blocks: list[int]
    hit_blocks: list[int]
    cached_blocks: list[int]  # pages this request added to the cache
    evicted: int  # cached blocks it evicted to make room
    bytes_shared: int  # keys and values it read from shared blocks (and a state checkpoint) instead of computing
    text: str = ""
    logits: torch.Tensor | None = field(default=None, repr=False)  # (generated, vocab) float32, with keep_logits
    seconds: float = 0.0  # serving it, start to end
    prompt_seconds: float = 0.0  # computing the prompt's missed positions (the time to the first token's logits)
    hit_tiers: dict[str, int] = field(default_factory=dict)  # hit blocks per medium (GPU, CPU, STORAGE), with tiers
    moves: list = field(default_factory=list)  # the tier moves it caused (kvexplore.prefix.tiers.Move)

    @property
    def modelled_seconds(self) -> float:
        """The tier moves' time, modelled from their links' bandwidths (not measured)."""
        return sum(m.seconds for m in self.moves)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / len(self.prompt)

    def explain(self) -> str:
        """The request in a few lines: hits, recomputed tokens, and each miss's reason."""
        head = (f"{self.label}: {count(len(self.prompt), 'prompt token')}, {self.hit_tokens} from the cache "
                f"({count(len(self.hit_blocks), 'block')}, {self.bytes_shared:,} B shared), {self.recomputed_tokens} "
                f"computed, {len(self.generated)} generated")
        lines = [head]
        if len(self.hit_tiers) > 1 or self.moves:
            lines.append("  hit blocks by tier: " + ", ".join(f"{n} {m}" for m, n in self.hit_tiers.items())
                         + f"; {len([m for m in self.moves if m.target])} block moves, "
                         f"{sum(m.nbytes for m in self.moves):,} B, {self.modelled_seconds * 1e6:.1f} µs modelled")
        return "\n".join(lines + [f"  - {m}" for m in self.misses])

    def __repr__(self) -> str:
        return (f"ServeResult({self.label}: hit {self.hit_tokens}/{len(self.prompt)}, recomputed "
                f"{self.recomputed_tokens}, misses {[m.kind for m in self.misses]})")
