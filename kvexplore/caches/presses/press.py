"""A press: a score per KV head and held position, from what the press needs to see; higher is kept first. A press only
scores. Which positions are kept (the budget: a ratio or a number of tokens, per layer on a schedule, per head or shared
across a layer's heads) is the cache's policy (:mod:`.budget`), and where the kept keys go (compacted or masked,
positions kept or re-rotated) is the cache's storage (:mod:`kvexplore.caches.strategies.evict`). Slots that are not
``valid`` are never kept, whatever the score."""

from __future__ import annotations

from typing import Any

import torch

from .observation import Observation


class Press:
    """Base class. ``name``: the registered name. ``queries``: how many of the most recent queries it reads (0: none).
    ``accumulates``: whether it reads the attention accumulated over every query so far (H2O)."""

    name = "press"
    queries = 0
    accumulates = False

    def score(self, obs: Observation) -> torch.Tensor:
        """``(B, H, S)`` scores; ``float('inf')`` marks a position the press always keeps."""
        raise NotImplementedError

    def options(self) -> dict[str, Any]:
        """The press's settings, for titles and records."""
        return {}

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts})"
