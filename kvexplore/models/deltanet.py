"""Qwen3-Next's gated DeltaNet: a linear-attention layer whose "cache" is a fixed-size state.

Per layer and sequence the state is the last ``kernel - 1`` inputs of a short causal convolution and one matrix
``S`` of ``(key dim, value dim)`` per value head (see :mod:`kvexplore.caches.layers.state`). The forward pass is
transformers 5.24's (checked in tests/engine/test_parity_state.py): ``in_proj_qkvz`` is grouped per *key* head
(``[q, k, v (r heads), z (r heads)]``, ``r = value heads / key heads``), l2 norms have eps 1e-6 inside the root,
and the gated delta rule runs in float32 (:func:`kvexplore.models.delta_rule.gated_delta_rule`: token by token, or
in chunks from ``CHUNKED_FROM`` tokens on, equal within float32 rounding: tests/engine/test_delta_rule.py). These
layers have hook points ``attn.state`` (the state after the step) and ``attn.out`` instead of the attention points.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config.norms import FLOAT32_NORM
from .blocks import RMSNorm
from ..caches.base import KVCache
from ..config.model_config import ModelConfig
from ..core.hooks import hook
from .delta_rule import gated_delta_rule, recurrent


def _l2_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c, d = config, config.hidden_size
        self.layer = layer
        self.hk, self.hv, self.dk, self.dv = (c.linear_key_heads, c.linear_value_heads, c.linear_key_dim,
                                              c.linear_value_dim)
        self.r, self.kernel = self.hv // self.hk, c.conv_kernel
        self.in_proj_qkvz = nn.Linear(d, self.hk * (2 * self.dk + 2 * self.r * self.dv), bias=False)
        self.in_proj_ba = nn.Linear(d, self.hk * 2 * self.r, bias=False)
        self.conv1d = nn.Conv1d(c.conv_channels, c.conv_channels, self.kernel, groups=c.conv_channels, bias=False,
                                padding=0)
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = RMSNorm(self.dv, c.rms_norm_eps, FLOAT32_NORM)
        self.out_proj = nn.Linear(self.hv * self.dv, d, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                tracer: Any) -> torch.Tensor:
        B, T, _ = x.shape
        hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.r
        qkvz = self.in_proj_qkvz(x).view(B, T, hk, 2 * dk + 2 * r * dv)  # grouped per key head
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(B, T, hv, dv)
        z = qkvz[..., 2 * dk + r * dv:].reshape(B, T, hv, dv)
        ba = self.in_proj_ba(x).view(B, T, hk, 2 * r)
        b, a = ba[..., :r].reshape(B, T, hv), ba[..., r:].reshape(B, T, hv)
        held = cache.states  # the linear-attention layers' states
        conv_state, state = held.read(self.layer)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1).transpose(1, 2)
        extended = torch.cat([conv_state.to(mixed.dtype), mixed], dim=-1)  # (B, channels, kernel - 1 + T)
        mixed = F.silu(F.conv1d(extended, self.conv1d.weight, groups=extended.shape[1])).transpose(1, 2)  # (B, T, C)
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = _l2_normalise(q.reshape(B, T, hk, dk).float()).repeat_interleave(r, 2) * dk ** -0.5
        k = _l2_normalise(k.reshape(B, T, hk, dk).float()).repeat_interleave(r, 2)
        v = v.reshape(B, T, hv, dv).float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # the log decay, (B, T, hv)
        if held.checkpointing and T > 1:  # a verification pass: the state after each position, token by token
            states: list[torch.Tensor] = []
            o, S = recurrent(q, k, v, g, torch.sigmoid(b.float()), state, states)
            K = self.kernel - 1
            convs = torch.stack([extended[..., t + 1:t + 1 + K] for t in range(T)])  # (T, B, channels, kernel - 1)
            held.write(self.layer, extended[..., -K:], S, (convs, torch.stack(states)))
        else:
            o, S = gated_delta_rule(q, k, v, g, torch.sigmoid(b.float()), state)
            held.write(self.layer, extended[..., -(self.kernel - 1):], S)
        if tracer is not None:  # the state after the step (a point only linear-attention layers have)
            hook(tracer, f"layers.{self.layer}.attn.state", S)
        o = self.norm(o.to(x.dtype)) * F.silu(z)  # (B, T, hv, dv)
        o = self.out_proj(o.reshape(B, T, hv * dv))
        return o if tracer is None else hook(tracer, f"layers.{self.layer}.attn.out", o)
