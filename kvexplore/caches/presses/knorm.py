"""KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"). Keys with a
*low* L2 norm draw high attention (the paper's observation), so the score of a held key ``k`` is ``-‖k‖₂``: each head
keeps its ``n_kept`` smallest-norm keys. It reads nothing but the keys (no queries, no attention), so it works with
fused attention kernels and costs one norm per key."""

from __future__ import annotations

import torch

from .observation import Observation
from .press import Press


class KNormPress(Press):
    name = "knorm"

    def score(self, obs: Observation) -> torch.Tensor:
        return -obs.keys.float().norm(dim=-1)
