"""Attention masks: which cached positions each new query may read."""

from __future__ import annotations

import torch


def causal_mask(pos: int, q_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean ``(T, S)`` mask over keys ``0..pos+T-1`` (in position order) for queries ``pos..pos+T-1``, or ``None``
    when plain causal attention with the queries at the end (SDPA's ``is_causal`` for T > 1, nothing for T == 1)
    is exact. ``window``: a query at ``p`` reads keys ``p - window < k <= p`` (transformers' sliding window)."""
    kv_len = pos + q_len
    windowed = window is not None and kv_len > window
    if not windowed and (q_len == 1 or pos == 0):
        return None
    return positions_mask(torch.arange(pos, kv_len, device=device), torch.arange(kv_len, device=device), window)


def positions_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean ``(T, S)``: query at ``q_pos[t]`` may read the key of position ``k_pos[s]``."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed
