"""How many positions a press keeps, and which: the budget (:class:`Budget`: a ``compression_ratio`` or ``kept_tokens``,
uniform or PyramidKV's pyramid over the layers; every head keeps at least one position, never more than it holds) and
the selection over heads (:func:`select`: per head, shared, or AdaKV's adaptive). The rules and their formulas:
docs/eviction.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...core.settings import choice, integer, real
from ...errors import SettingsError

SCHEDULES = ("uniform", "pyramid")
HEADS = ("per-head", "shared", "adaptive")


@dataclass(frozen=True)
class Budget:
    """See the module docstring. ``alpha``: AdaKV's safeguard share; ``beta``: PyramidKV's top-to-mean ratio."""

    compression_ratio: float | None = 0.5
    kept_tokens: int | None = None
    schedule: str = "uniform"
    heads: str = "per-head"
    alpha: float = 0.2
    beta: float = 20.0

    def __post_init__(self) -> None:
        if self.kept_tokens is not None:
            integer(self.kept_tokens, "kept_tokens", minimum=1, hint=" (positions each head keeps)")
        elif self.compression_ratio is None:
            raise SettingsError("give compression_ratio (0 <= r < 1) or kept_tokens (a number of positions)")
        else:
            real(self.compression_ratio, "compression_ratio", 0.0, hint=" and < 1 (the share of positions dropped)")
            if self.compression_ratio >= 1:
                raise SettingsError(f"compression_ratio must be >= 0.0 and < 1 (the share of positions dropped), got "
                                    f"{self.compression_ratio}: a ratio of 1 would keep nothing")
        choice(self.schedule, "schedule", SCHEDULES)
        choice(self.heads, "heads", HEADS)
        real(self.alpha, "alpha", 0.0, 1.0)
        real(self.beta, "beta", 1.0)

    def mean_kept(self, n: int) -> int:
        """Positions per head kept on average over the layers when each holds ``n``."""
        if self.kept_tokens is not None:
            return max(1, min(n, self.kept_tokens))
        return max(1, int(n * (1 - self.compression_ratio)))

    def per_layer(self, n: int, layers: int, target: int | None = None) -> list[int]:
        """Positions per head each of ``layers`` pressed layers keeps (in order) when each holds ``n``; ``target``
        replaces the mean (a decoding press's target)."""
        m = self.mean_kept(n) if target is None else max(1, min(n, target))
        if self.schedule == "uniform" or layers == 1:
            return [m] * layers
        low = m / self.beta
        high = 2 * m - low
        return [max(1, min(n, round(high - (high - low) * i / (layers - 1)))) for i in range(layers)]


def best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` highest ``scores`` along the last axis; of equal scores the first (the earliest slot: the
    earliest position, in either storage) goes first, whatever the shape or the batch (topk breaks ties as its
    kernel happens to, so a batch row and the same sequence alone could keep different positions)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def select(scores: torch.Tensor, valid: torch.Tensor, n_kept: int, heads: str = "per-head",
           alpha: float = 0.2) -> torch.Tensor:
    """The positions to keep: ``(B, H, S)`` bool, at most ``n_kept`` per head on average and never a slot that is not
    ``valid`` (see the module docstring for ``heads``); of equal scores, the earliest is kept."""
    B, H, S = scores.shape
    scores = scores.float().masked_fill(~valid, float("-inf"))
    keep = torch.zeros_like(valid)
    if heads == "shared":
        big = torch.finfo(torch.float32).max
        finite = scores.clamp(min=-big, max=big)  # a kept-always inf counts as the largest score
        mean = finite.mean(1, keepdim=True).masked_fill(~valid.any(1, keepdim=True), float("-inf"))
        idx = best(mean, min(n_kept, S)).expand(B, H, -1)
        return keep.scatter(-1, idx, True) & valid
    if heads == "per-head":
        idx = best(scores, min(n_kept, S))
        return keep.scatter(-1, idx, True) & valid
    guard = min(S, int(alpha * n_kept))  # adaptive: a safeguard per head, the rest to the best of the layer
    if guard:
        keep = keep.scatter(-1, best(scores, guard), True) & valid
    for b in range(B):
        rest = n_kept * H - int(keep[b].sum())
        if rest > 0:
            flat = scores[b].masked_fill(keep[b], float("-inf")).reshape(H * S)
            chosen = torch.zeros_like(flat, dtype=torch.bool)
            chosen[best(flat, min(rest, H * S))] = True
            keep[b] |= chosen.view(H, S) & valid[b]
    return keep
