"""Quality measures computed with the model itself: perplexity over a token sequence."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..caches.strategies.none import NoCache
from ..models.model import Model
from ..errors import SettingsError
from ..core import host


def perplexity(model: Model, ids: Sequence[int], window: int = 256) -> float:
    """Perplexity of ``ids`` in non-overlapping windows of ``window`` tokens (each window scored on its own:
    token t is predicted from the tokens before it in its window)."""
    if len(ids) < 2:
        raise SettingsError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    if window < 2:
        raise SettingsError(f"window must be at least 2 tokens, got {window}")
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = list(ids[start:start + window])
        if len(chunk) < 2:
            break
        cache = NoCache(model.config, dtype=model.dtype, device=model.device)
        logits = model(torch.tensor([chunk]), cache, 0)[0]  # ids on the host: the model moves them
        total += negative_log_likelihood(logits, chunk)
        count += len(chunk) - 1
    return math.exp(total / count)


def negative_log_likelihood(logits: torch.Tensor, ids: Sequence[int]) -> float:
    """Summed ``-log p(ids[t] | ids[:t])`` for t >= 1, from ``logits`` ``[len(ids), vocab]`` of any model."""
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)
    target = host.upload(list(ids[1:]), logits.device)[:, None]
    return -float(host.fetch([logp.gather(1, target).sum()])[0])
