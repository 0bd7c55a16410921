"""What a speculative verification reads from the generator it serves (the speculation lab stands on the
generator; the generator hands it this and imports nothing of it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Target:
    """What a verification reads from its generator (:meth:`~kvexplore.Generator.target`): model runner, cache,
    tracer, sampling settings, the RNG drafts and corrections draw from, and the top candidates each record keeps."""

    executor: Any
    cache: Any
    tracer: Any
    sampling: Any
    rng: torch.Generator
    top_candidates: int
