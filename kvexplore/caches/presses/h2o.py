"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models").

Heavy hitters: the score of a held key is the attention it has received, summed over every query so far (the
prompt's and each decoded token's) and over the query heads that read its KV head. The ``recent_ratio`` share of
the budget goes to the newest positions regardless (the paper keeps heavy hitters and recent tokens half and half).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.settings import real
from .observation import Observation
from .press import Press


class H2OPress(Press):
    name = "h2o"
    accumulates = True

    def __init__(self, recent_ratio: float = 0.5) -> None:
        self.recent_ratio = real(recent_ratio, "recent_ratio", 0.0, 1.0)

    def options(self) -> dict[str, Any]:
        return dict(recent_ratio=self.recent_ratio)

    def score(self, obs: Observation) -> torch.Tensor:
        recent = int(obs.n_kept * self.recent_ratio)
        scores = obs.accumulated.clone()
        return scores.masked_fill(obs.positions >= obs.length - recent, float("inf")) if recent else scores
