"""What a materialised attention does with its scores and probabilities: the soft cap, the softmax with learned sinks,
the weighted sum of the values rounded like SDPA."""

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


def soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Scores soft-capped at ``softcap`` (``tanh(s / cap) * cap``), or as they are without one."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax over the keys (last axis) of ``scores`` ``(..., heads, rows, keys)``; with learned ``sinks``
    ``(heads,)`` each head's sink is one more column of the softmax, dropped after it (a row then sums to less than
    1: the rest is the sink's share, which reads no value)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().view(-1, 1, 1).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
