"""A layer's matrix products for one token, on a copy of its weights laid out for streaming: what the regional
compiled step (:mod:`.regional`) runs instead of ``nn.Linear``.

The weights are stored in blocks of :data:`BLOCK` output rows, ``[out / BLOCK, in, BLOCK]``, and the product is a
multiply and a sum over ``in``: inductor turns that into one loop per block that reads it front to back, a vector of
``BLOCK`` outputs at a time (the block size was timed: docs/benchmarks.md, "Compiled step reuse"). Unlike frozen
weights they are graph inputs, so one graph serves every layer of the same shapes. The blocks are a second copy of
the weights, made once per model: a later change to the model's weights is not seen by them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

BLOCK = 16  # output rows per block: one AVX-512 vector of float32


def blocked(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` as ``[ceil(out / BLOCK), in, BLOCK]``, zero rows added to fill the last block."""
    w = weight.detach()
    out, width = w.shape
    if pad := -out % BLOCK:
        w = torch.cat([w, w.new_zeros(pad, width)])
    return w.reshape(-1, BLOCK, width).transpose(1, 2).contiguous()


class BlockedLinear(nn.Module):
    """``F.linear(x, weight, bias)`` from a :func:`blocked` copy of ``weight`` (``bias`` is the caller's own)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("blocks", blocked(weight), persistent=False)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.reshape(-1, 1, x.shape[-1], 1) * self.blocks).sum(-2).reshape(*x.shape[:-1], -1)
        if y.shape[-1] != self.out_features:
            y = y[..., : self.out_features]
        return y if self.bias is None else y + self.bias


def blocked_twin(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose ``nn.Linear`` submodules are :class:`BlockedLinear` (their weights copied
    into blocks); every other submodule is copied the same way, and every other parameter is the module's own."""
    twin = copy.copy(module)
    twin._modules = {name: (BlockedLinear(child.weight, child.bias) if isinstance(child, nn.Linear) else
                            None if child is None else blocked_twin(child))
                     for name, child in module._modules.items()}
    return twin


def tensors_of(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``module`` by name, in a fixed order (what a graph over it takes as inputs)."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def nbytes(module: Any) -> int:
    """Bytes the blocked copies under ``module`` hold."""
    return sum(m.blocks.nbytes for m in module.modules() if isinstance(m, BlockedLinear))
