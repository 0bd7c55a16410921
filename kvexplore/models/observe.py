"""Attention probabilities for a tracer that takes them in chunks of query rows (the explorer's): the whole
``(heads, T, S)`` matrix of a long prefill is never held, only ``heads x chunk x S`` at a time.

A tracer opts in with three members: ``row_chunks(layer, T)`` (the boundaries of the query-row chunks to compute,
e.g. ``[0, 64, 128, ..., T]``; it may skip rows: ``[T - 1, T]`` computes the newest row only), ``column_align``
(key columns are computed from a multiple of it) and ``observe_rows(layer, r0, probs, c0, S)`` (``probs``
``(heads, rows, keys)`` float32 of rows ``r0..`` over key columns ``c0..`` of the ``S`` read, first sequence). The
probabilities are computed exactly as :meth:`~kvexplore.models.model.Attention._explicit` computes them (float32 scores,
soft cap, mask, learned sinks, softmax); columns a chunk's mask rules out entirely are skipped (they would read 0), so a
causal prefill computes half the scores. The layer's output does not come from here: it stays SDPA's (or the
explicit path's for soft-capped or sink models), as untraced.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core import host
from .attend import soft_cap, softmax_with_sinks


def observes_rows(tracer: Any) -> bool:
    """Whether ``tracer`` takes attention probabilities in chunks of rows."""
    return tracer is not None and callable(getattr(tracer, "observe_rows", None))


def observe(tracer: Any, layer: int, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
            softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
    """Compute ``layer``'s probabilities chunk by chunk and hand each to ``tracer.observe_rows``.

    ``q`` ``(B, nh, T, hd)``, ``k`` ``(B, nkv, S, hd)`` (what attention read), ``mask`` as the cache gave it
    (``(T, S)`` or broadcastable, True = may read; None: causal for several tokens, everything for one)."""
    _, nh, T, hd = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    keys = k[0].float()  # (nkv, S, hd)
    if mask is not None and mask.dim() == 4:  # one per KV head (a pressed layer): one per query head
        m2 = mask[0].repeat_interleave(g, dim=0)  # (nh, T, S): the first sequence's
    else:
        m2 = None if mask is None else mask.reshape(-1, *mask.shape[-2:])[0]  # (T, S): the first sequence's
    align = max(1, int(getattr(tracer, "column_align", 1)))
    bounds = tracer.row_chunks(layer, T)
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        C = r1 - r0
        if m2 is not None and C > 4:  # the columns some row of the chunk may read (one small transfer)
            allowed = m2[..., r0:r1, :].reshape(-1, S).any(0)
            where = torch.arange(S, device=allowed.device)
            ends = torch.stack([torch.where(allowed, where, S).min(), torch.where(allowed, where, -1).max() + 1])
            lo, hi = (int(v) for v in host.fetch([ends])[0].tolist())
            lo, hi = (lo, hi) if hi > lo else (0, S)
        elif m2 is not None:  # a decode step's row or few: every column (no transfer in the step)
            lo, hi = 0, S
        else:
            lo, hi = 0, (S - T + r1 if T > 1 else S)
        lo -= lo % align
        hi = min(S, hi + (-hi) % align)
        qc = q[0, :, r0:r1].float().reshape(nkv, g * C, hd)
        scores = (qc @ keys[:, lo:hi].transpose(-1, -2)) * scale  # (nkv, g*C, hi-lo)
        scores = soft_cap(scores, softcap).view(nh, C, hi - lo)
        if m2 is not None:
            scores = scores.masked_fill(~m2[..., r0:r1, lo:hi], float("-inf"))
        elif T > 1:  # causal: row r reads columns up to r + S - T; only the block right of r0 + S - T has any
            d = max(r0 + S - T + 1, lo)
            if d < hi:
                cols = torch.arange(d, hi, device=q.device)
                rows = torch.arange(r0, r1, device=q.device) + (S - T)
                scores[..., d - lo:].masked_fill_(cols[None, :] > rows[:, None], float("-inf"))
        probs = softmax_with_sinks(scores, sinks)
        tracer.observe_rows(layer, r0, probs, lo, S)
