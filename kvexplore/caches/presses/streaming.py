"""StreamingLLM as a press (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"). Keep the
first ``sinks`` positions (the attention sinks) and the most recent ones: the score is ``inf`` for a sink and the
position itself otherwise, so a budget of ``n_kept`` keeps the sinks and the newest ``n_kept - sinks``. The same set the
``sink`` cache keeps, but reached by eviction from a full prompt (and choosable per layer)."""

from __future__ import annotations

from typing import Any

import torch

from ...core.settings import integer
from .observation import Observation
from .press import Press


class StreamingPress(Press):
    name = "streaming"

    def __init__(self, sinks: int = 4) -> None:
        self.sinks = integer(sinks, "sinks", minimum=0)

    def options(self) -> dict[str, Any]:
        return dict(sinks=self.sinks)

    def score(self, obs: Observation) -> torch.Tensor:
        return obs.positions.float().masked_fill(obs.positions < self.sinks, float("inf"))
