"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation").

The last ``window`` queries of the prompt (the observation window: usually the question) vote for the keys: with
``A`` the attention ``(heads, window, keys)`` of those queries,

    vote[h, j] = Σ_i A[h, i, j]                       (summed over the window's queries)
    score[h, j] = pool_kernel(vote[h, :])[j]          (averaged over ``kernel`` neighbouring held keys)

summed over the query heads that read KV head ``h``. The window's own keys are always kept (score ``inf``) and take
no part in the pooling. The defaults (average pooling, kernel 5, window 32) and how they compare with kvpress's:
docs/eviction.md.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...core.settings import choice, positive_int
from ...errors import SettingsError
from .observation import Observation, in_position_order, per_kv_head
from .press import Press


POOLINGS = ("avg", "max")  # the first is the default


class SnapKVPress(Press):
    name = "snapkv"

    def __init__(self, window: int = 32, kernel: int = 5, pooling: str = "avg") -> None:
        self.queries = self.window = positive_int(window, "window")
        self.kernel = positive_int(kernel, "kernel")
        if self.kernel % 2 == 0:
            raise SettingsError(f"kernel must be odd so the pooling is centred on each key, got {kernel}; "
                                f"use {kernel + 1}")
        self.pooling = choice(pooling, "pooling", POOLINGS)

    def options(self) -> dict[str, Any]:
        return dict(window=self.window, kernel=self.kernel, pooling=self.pooling)

    def score(self, obs: Observation) -> torch.Tensor:
        attn = obs.attention()  # (B, nh, W, S)
        B, nh, W, S = attn.shape
        H = obs.keys.shape[1]
        recent = obs.positions >= obs.length - W  # (B, H, S): the window's own keys, the newest held
        # a window key votes 0: what the pooling's padding gives after the last key before the window (0 counted by
        # the average, below any vote for the maximum), as pooling the keys before the window alone does
        vote = attn.sum(2).masked_fill(recent.repeat_interleave(nh // H, 1), 0.0)  # (B, nh, S)
        pool = F.max_pool1d if self.pooling == "max" else F.avg_pool1d

        def pooled(x: torch.Tensor) -> torch.Tensor:
            return pool(x.reshape(B * nh, 1, S), self.kernel, stride=1, padding=self.kernel // 2).reshape(B, nh, S)

        scores = per_kv_head(in_position_order(obs.valid, obs.positions, vote, pooled), H)
        return scores.masked_fill(recent, float("inf"))
