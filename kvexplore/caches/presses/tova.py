"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Token Omission Via Attention: the newest query's attention, averaged over *all* the layer's query heads, scores
each held key; one decision per layer (every KV head keeps the same positions). Run during decoding
(``decode_every=1``) it drops, at each step, the key the newest token attends to least.
"""

from __future__ import annotations

import torch

from .observation import Observation
from .press import Press


class TOVAPress(Press):
    name = "tova"
    queries = 1

    def score(self, obs: Observation) -> torch.Tensor:
        attn = obs.attention(last=1)[:, :, 0]  # (B, nh, S)
        mean = attn.mean(1, keepdim=True)  # (B, 1, S): averaged over every query head of the layer
        return mean.expand(-1, obs.keys.shape[1], -1)
