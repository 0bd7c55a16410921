"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling with a seeded RNG."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    """``temperature == 0`` means greedy (argmax); otherwise sample after top-k then top-p filtering."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Probabilities ``[vocab]`` (float32) the sampler draws from: tempered, top-k and top-p applied."""
    logits = logits.float() / settings.temperature
    if settings.top_k is not None and settings.top_k < logits.shape[-1]:
        keep = torch.topk(logits, settings.top_k).indices  # exactly k, even when values tie
        logits = torch.full_like(logits, float("-inf")).scatter(-1, keep, logits.gather(-1, keep))
    probs = logits.softmax(-1)
    if settings.top_p is not None and settings.top_p < 1:
        sorted_probs, order = probs.sort(descending=True, stable=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
        drop = before >= settings.top_p  # keep the smallest prefix whose mass reaches top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def choose(logits: torch.Tensor, settings: SamplingSettings, rng: torch.Generator) -> int:
    """Pick one token id from ``logits`` ``[vocab]``."""
    if settings.greedy:
        return int(logits.argmax())
    probs = filtered_probs(logits, settings).cpu()
    return int(torch.multinomial(probs, 1, generator=rng))
