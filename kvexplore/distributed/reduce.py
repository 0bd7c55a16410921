"""The one collective tensor parallelism needs: the sum over ranks of a row-split product (the attention's ``o_proj``
and the MLP's ``down_proj``), done by ``torch.distributed.all_reduce``, and what it carried (:class:`Traffic`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class Traffic:
    """What a rank's all-reduces carried: calls, the bytes of the tensors summed (each rank's share of a ring
    all-reduce sends about ``2 (tp - 1) / tp`` of them), and the seconds spent in them (waiting included)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, tensor: torch.Tensor, seconds: float) -> None:
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()
        self.seconds += seconds

    def since(self, before: "Traffic") -> "Traffic":
        return Traffic(self.calls - before.calls, self.bytes - before.bytes, self.seconds - before.seconds)

    def copy(self) -> "Traffic":
        return Traffic(self.calls, self.bytes, self.seconds)


class RowParallelLinear(nn.Linear):
    """A linear layer holding a slice of the input channels (its rows of the full product): each rank computes a
    partial sum, and the all-reduce adds them, so every rank has the full output. The bias is added on rank 0 only
    (the others hold zeros), so it is counted once."""

    def __init__(self, linear: nn.Linear, traffic: Traffic, group=None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.traffic, self.group = traffic, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if dist.get_world_size(self.group) == 1:  # nothing to sum (gloo would still make the call)
            return y
        t0 = time.perf_counter()
        dist.all_reduce(y, group=self.group)
        self.traffic.add(y, time.perf_counter() - t0)
        return y
