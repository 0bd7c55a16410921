"""What a materialised attention does with its probabilities: the weighted sum of the values, rounded like SDPA."""

from __future__ import annotations

import torch


def weigh_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``probs @ v`` rounded as a fused attention kernel does in low precision: the weights, scaled so the largest
    is 1, are rounded to ``v``'s dtype, the sum runs in float32 and is rescaled once, then rounded. In float32 a
    plain product."""
    if v.dtype == torch.float32:
        return probs @ v
    top = probs.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    weights = (probs / top).to(v.dtype)
    return ((weights.float() @ v.float()) * top).to(v.dtype)
