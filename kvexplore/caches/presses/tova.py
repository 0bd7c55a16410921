"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"). Token Omission Via Attention: the newest query's
attention, averaged over *all* the layer's query heads, scores each held position (a query head gives 0 to a position
its KV head does not hold); one decision per layer (every KV head keeps the same positions, once they hold the same).
Run during decoding (``decode_every=1``) it drops, at each step, the key the newest token attends to least."""

from __future__ import annotations

import torch

from .observation import Observation
from .press import Press


class TOVAPress(Press):
    name = "tova"
    queries = 1

    def score(self, obs: Observation) -> torch.Tensor:
        attn = obs.attention(last=1)[:, :, 0]  # (B, nh, S), 0 where a slot is not held
        B, nh, S = attn.shape
        H = obs.keys.shape[1]
        # by position, not by slot: heads that hold different positions (a compact storage) keep them in different
        # slots, so the mean over the query heads is summed into the positions, then read back into each head's slots
        where = obs.positions.clamp(min=0)  # (B, H, S); an empty slot (-1) adds its 0 to position 0
        total = attn.new_zeros((B, obs.length)).scatter_add_(1, where.repeat_interleave(nh // H, 1).reshape(B, -1),
                                                             attn.reshape(B, -1))
        return (total / nh).gather(1, where.reshape(B, -1)).view(B, H, S)
