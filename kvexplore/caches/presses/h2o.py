"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models").
Heavy hitters: the score of a held key is the attention it has received, summed over every query so far and over the
query heads that read its KV head; the ``recent_ratio`` share of the budget goes to the newest positions.
``normalize=True`` divides each key's sum by the number of queries that read it (a held key at ``p`` of ``L`` positions
was read by ``L - p``: evicted keys are gone for good), kvpress's ``ObservedAttentionPress`` (docs/eviction.md)."""

from __future__ import annotations

from typing import Any

import torch

from ...core.settings import real
from ...errors import SettingsError
from .observation import Observation
from .press import Press


class H2OPress(Press):
    name = "h2o"
    accumulates = True

    def __init__(self, recent_ratio: float = 0.5, normalize: bool = False) -> None:
        self.recent_ratio = real(recent_ratio, "recent_ratio", 0.0, 1.0)
        if not isinstance(normalize, bool):
            raise SettingsError(f"normalize must be True or False, got {normalize!r} ({type(normalize).__name__}); "
                                f"use normalize=True to divide each key's attention by the queries that saw it "
                                f"(kvpress's ObservedAttention), normalize=False for H2O's plain sum")
        self.normalize = normalize

    def options(self) -> dict[str, Any]:
        return dict(recent_ratio=self.recent_ratio, normalize=self.normalize)

    def score(self, obs: Observation) -> torch.Tensor:
        recent = int(obs.n_kept * self.recent_ratio)
        scores = obs.accumulated.clone()
        if self.normalize:  # the queries at positions p .. length - 1 read the key at p
            seen = (obs.length - obs.positions).clamp(min=1)
            scores = scores / seen.to(scores.dtype)
        return scores.masked_fill(obs.positions >= obs.length - recent, float("inf")) if recent else scores
