"""Attention rows the store no longer holds at full resolution, recomputed: a prefill of the tokens up to the last
row asked into a fresh cache of the lane's strategy, computing only the rows asked of one layer and head (in chunks,
reduced at once) and stopping after that layer. Exact for the prefill's rows; a strategy whose decode steps read
otherwise than a prefill (a ring, a sink cache, a quantized cache) had a different row then, as the view says.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..caches.factory import make_cache
from ..core import host
from ..errors import SettingsError
from .rowbins import causal_cells, reduce_rows


class _Done(Exception):
    """Raised after the layer asked: the rest of the forward pass is not needed."""


class _OneHead:
    """A tracer taking one layer's and head's rows ``q0..q1-1`` in bins of ``rs`` x ``cs`` (from ``c0``)."""

    def __init__(self, layer: int, head: int, q0: int, q1: int, rs: int, cs: int, c0: int, nc: int) -> None:
        self.layer, self.head, self.q0, self.q1 = layer, head, q0, q1
        self.rs, self.cs, self.cb0, self.nc = rs, cs, c0 // cs, nc
        self.rb0 = q0 // rs
        nr = -(-q1 // rs) - self.rb0
        self.max = np.zeros((nr, nc), dtype=np.float32)
        self.sum = np.zeros((nr, nc), dtype=np.float64)
        self.column_align = cs

    def wants_attention(self, layer: int) -> bool:
        return layer == self.layer

    def hook(self, name: str, t: torch.Tensor) -> None:
        return None

    def row_chunks(self, layer: int, T: int) -> list[int]:
        size = max(64, self.rs)  # chunks after the first start on a multiple of the row bins
        return [self.q0, *range(self.q0 - self.q0 % size + size, self.q1, size), self.q1]

    def observe_rows(self, layer: int, r0: int, probs: torch.Tensor, c0: int, keys: int = 0) -> None:
        p = probs[self.head: self.head + 1]
        rb, cb, mx, sm, _ = reduce_rows(p, r0, c0, self.rs, self.cs)
        mx, sm = (t.numpy() for t in host.fetch([mx[0], sm[0]]))  # the one transfer of the chunk
        r, c = rb - self.rb0, cb - self.cb0  # where the block sits among the bins asked
        lo_c, hi_c = max(0, -c), min(mx.shape[1], self.nc - c)
        if hi_c > lo_c:
            rows = slice(r, r + mx.shape[0])
            cols = slice(c + lo_c, c + hi_c)
            self.max[rows, cols] = np.maximum(self.max[rows, cols], mx[:, lo_c:hi_c])
            self.sum[rows, cols] += sm[:, lo_c:hi_c]
        if r0 + probs.shape[1] >= self.q1:
            raise _Done


def recompute(model: Any, tokens: Sequence[int], strategy: str, options: dict[str, Any], layer: int, head: int,
              q0: int, q1: int, rs: int, cs: int, c0: int, nc: int) -> tuple[np.ndarray, np.ndarray]:
    """``(max, mean)`` of ``layer``/``head``'s attention of query rows ``q0..q1-1`` over bins of ``rs`` rows x
    ``cs`` keys (row bins from ``q0 // rs``, ``nc`` key bins from position ``c0``; sizes 1: full resolution),
    recomputed by a prefill of ``tokens[:q1]`` into a fresh ``strategy`` cache (its ``options``; the pre-allocated
    cache where that cannot hold them). NaN where a bin has no causal cell."""
    if not 0 < q1 <= len(tokens):
        raise SettingsError(f"rows up to {q1 - 1} were asked but the sequence has {len(tokens)} tokens")
    opts = {k: v for k, v in options.items() if k != "max_seq_len"}
    try:
        cache = make_cache(strategy, model, max_seq_len=q1, **opts)
    except (SettingsError, TypeError, ValueError):
        cache = make_cache("preallocated", model, max_seq_len=q1)
    tracer = _OneHead(layer, head, q0, q1, rs, cs, c0, nc)
    ids = torch.tensor([list(tokens[:q1])], dtype=torch.long)
    try:
        with torch.inference_mode():
            model(ids, cache, 0, tracer=tracer, last_only=True)
    except _Done:
        pass
    cells = causal_cells(q0, q1, rs, tracer.rb0, tracer.max.shape[0], cs, tracer.cb0, nc)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(cells > 0, tracer.sum / cells, np.nan).astype(np.float32)
    return np.where(cells > 0, tracer.max, np.nan).astype(np.float32), mean


class LaneAttention:
    """A lane's attention as the views ask for it: its bounded ``store`` and, when the lane runs kvexplore's own model,
    :meth:`recompute` (the last answer is kept, so redrawing a zoomed figure does not recompute)."""

    def __init__(self, store: Any, model: Any = None, tokens: Callable[[], Sequence[int]] | None = None,
                 strategy: str = "preallocated", options: dict[str, Any] | None = None) -> None:
        self.store, self.model, self._tokens = store, model, tokens
        self.strategy, self.options = strategy, dict(options or {})
        self._last: tuple | None = None

    @property
    def can_recompute(self) -> bool:
        return self.model is not None and self._tokens is not None

    def recompute(self, layer: int, head: int, q0: int, q1: int, rs: int, cs: int, c0: int, nc: int):
        tokens = list(self._tokens()[:q1])
        key = (layer, head, q0, q1, rs, cs, c0, nc, tuple(tokens))
        if self._last is None or self._last[0] != key:
            self._last = (key, recompute(self.model, tokens, self.strategy, self.options, layer, head, q0, q1, rs,
                                         cs, c0, nc))
        return self._last[1]
