"""Mixtures of experts: a router picks ``experts_per_token`` of ``num_experts`` MLPs for each token (gpt-oss's,
DeepSeek's and Qwen3-Next's), as transformers 5.24 computes them (checked in tests/engine/test_parity_2025.py).
Nothing here touches the KV cache.

gpt-oss (:class:`MixtureOfExperts`): the softmax runs over the router's top k logits only; each expert is a clamped,
biased GLU whose gate and up projections are one matrix ``[experts, in, out]`` with their columns interleaved
(even: gate, odd: up). DeepSeek-V3 (:class:`DeepseekExperts`): sigmoid scores, a correction bias used only to
choose, experts in ``n_group`` groups of which the ``topk_group`` with the best two-expert sums are eligible, plus
``n_shared_experts`` always on as one MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from ..core import host
from .blocks import MLP
from ..config.model_config import ModelConfig


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
        for e in host.values(chosen.unique()):  # only the experts some token chose run (a sync on CUDA: see host)
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gu = x[rows] @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e]
            gate, up = gu[:, 0::2].clamp(max=self.limit), gu[:, 1::2].clamp(-self.limit, self.limit)
            y = ((up + 1) * gate * torch.sigmoid(gate * self.alpha)) @ ex.down_proj[e] + ex.down_proj_bias[e]
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out.view(shape)


class DeepseekRouter(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_experts))
        self.k, self.groups, self.group_k = config.experts_per_token, config.expert_groups, config.groups_per_token
        self.normalise, self.scaling = config.norm_topk_prob, config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing weights and the chosen experts, each ``(N, k)``, for tokens ``x`` ``(N, D)``."""
        scores = (x.float() @ self.weight.float().t()).sigmoid()  # (N, E), in float32 like transformers
        choice = scores + self.e_score_correction_bias
        N, E = choice.shape
        by_group = choice.view(N, self.groups, E // self.groups)
        best = by_group.topk(2, dim=-1).values.sum(-1).topk(self.group_k, dim=-1, sorted=False).indices  # (N, g)
        eligible = torch.zeros(N, self.groups, dtype=torch.bool, device=x.device).scatter_(1, best, True)
        choice = choice.masked_fill(~eligible.repeat_interleave(E // self.groups, dim=1), float("-inf"))
        chosen = choice.topk(self.k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class DeepseekExperts(nn.Module):
    """``mlp`` of a DeepSeek-V3 MoE layer: ``mlp.gate``, ``mlp.experts`` and ``mlp.shared_experts``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = DeepseekRouter(config)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        if config.shared_experts:
            self.shared_experts = MLP(config, config.moe_intermediate_size * config.shared_experts)
        self.shared = bool(config.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen = self.gate(flat)
        out = torch.zeros_like(flat)
        for e in host.values(chosen.unique()):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            y = self.experts[e](flat[rows])
            out.index_add_(0, rows, (y * weights[rows, slot, None]).to(out.dtype))
        out = out.view(shape)
        return out + self.shared_experts(x) if self.shared else out


class SharedExpertMoE(nn.Module):
    """``mlp`` of a Qwen3-Next layer: a softmax router over every expert, the top k renormalised
    (``norm_topk_prob``), each expert a SwiGLU MLP, plus one shared expert scaled by
    ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config, config.moe_intermediate_size) for _ in range(config.num_experts))
        self.shared_expert = MLP(config, config.shared_expert_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.k, self.normalise = config.experts_per_token, config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen = self.gate(flat).softmax(dim=-1, dtype=torch.float32).topk(self.k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in host.values(chosen.unique()):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, (self.experts[e](flat[rows]) * weights[rows, slot, None]).to(out.dtype))
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view(shape)
