"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference"). Keys
that point in a direction unlike the others carry information the rest does not: with ``a`` the mean of the head's
normalised held keys (the anchor), the score of key ``k`` is ``-cos(k, a)``, so each head keeps its most dissimilar
keys. Query-agnostic and attention-free, like KNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .observation import Observation
from .press import Press


class KeyDiffPress(Press):
    name = "keydiff"

    def score(self, obs: Observation) -> torch.Tensor:
        unit = F.normalize(obs.keys.float(), dim=-1)  # (B, H, S, w)
        weight = obs.valid.unsqueeze(-1).float()
        anchor = (unit * weight).sum(2) / weight.sum(2).clamp_min(1.0)  # (B, H, w): over the held keys only
        return -F.cosine_similarity(unit, anchor.unsqueeze(2), dim=-1)
