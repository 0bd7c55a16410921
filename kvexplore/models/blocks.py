"""The building blocks every decoder layer shares: RMSNorm in its three styles and the gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config.norms import GEMMA_NORM, LLAMA_NORM
from ..config.model_config import ModelConfig


class RMSNorm(nn.Module):
    """RMSNorm, normalised in float32. ``style`` says how the weight is applied (see
    :mod:`kvexplore.config.norms`): Llama casts back to the dtype before ``* weight``; Gemma 3 multiplies by
    ``1 + weight`` in float32, gpt-oss and Gemma 4 by ``weight`` in float32. ``scale=False``: no weight at all
    (Gemma 4's value norm)."""

    def __init__(self, dim: int, eps: float, style: str = LLAMA_NORM, scale: bool = True) -> None:
        super().__init__()
        if scale:
            self.weight = nn.Parameter(torch.zeros(dim) if style == GEMMA_NORM else torch.ones(dim))
        self.eps, self.style, self.scale = eps, style, scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if not self.scale:
            return xf.to(x.dtype)
        if self.style == LLAMA_NORM:
            return self.weight * xf.to(x.dtype)
        w = self.weight.float() + 1.0 if self.style == GEMMA_NORM else self.weight.float()
        return (xf * w).to(x.dtype)


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))`` (SwiGLU with silu; Gemma's GeGLU with gelu-tanh)."""

    def __init__(self, config: ModelConfig, width: int) -> None:
        super().__init__()
        d, f, bias = config.hidden_size, width, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
