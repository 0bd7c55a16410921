"""gpt-oss's mixture of experts: a router picks ``experts_per_token`` of ``num_experts`` MLPs for each token.

As transformers 5.24 computes it (checked in tests/test_parity_2025.py): the router's logits (with a bias) are
cut to the top k, and the softmax runs over those k only. Each chosen expert is a clamped, biased GLU whose gate
and up projections are one fused matrix with their columns interleaved (even: gate, odd: up), stored
``[experts, in, out]`` and applied as ``x @ W``::

    gate, up = (x @ gate_up[e] + b[e])[0::2], [1::2]
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    y_e = ((up + 1) * gate * sigmoid(alpha * gate)) @ down[e] + down_bias[e]

and the token's output is the routing-weighted sum of its experts' ``y_e`` (the down bias weighted too).
Nothing here touches the KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig


class Router(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_experts))


class Experts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, d, f = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, d, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * f))
        self.down_proj = nn.Parameter(torch.zeros(e, f, d))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, d))


class MixtureOfExperts(nn.Module):
    """``mlp`` of a gpt-oss layer: ``mlp.router`` and ``mlp.experts`` as in the checkpoint."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        self.k, self.alpha, self.limit = config.experts_per_token, config.swiglu_alpha, config.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        logits = x @ self.router.weight.t() + self.router.bias  # (N, E)
        top, chosen = logits.topk(self.k, dim=-1)  # (N, k)
        weights = top.softmax(dim=-1, dtype=torch.float32).to(x.dtype)
        out = torch.zeros_like(x)
        ex = self.experts
        for e in chosen.unique().tolist():  # only the experts some token chose run, each on its tokens
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gu = x[rows] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
            gate, up = gu[:, 0::2].clamp(max=self.limit), gu[:, 1::2].clamp(-self.limit, self.limit)
            y = ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ ex.down_proj[e] + ex.down_proj_bias[e]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out.view(shape)
