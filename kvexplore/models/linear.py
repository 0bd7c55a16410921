"""The ``nn.Linear`` the models are built from: a decoding step's one-row products may take a faster kernel.

Decoding one token multiplies a single row by every weight matrix, so a step's speed is how fast it reads the
weights, and torch's ``F.linear`` reads them on one core here (MKL's matrix-vector product). :class:`Linear` and
:func:`linear` hand such a product to the kernel of an installed source (:func:`install`; the package installs
:mod:`kvexplore.runtime.products`, a compiled loop over the model's own weights on every thread) where
:func:`takes_kernel` says it applies, and to ``F.linear`` otherwise. Weights, state dicts and every other use are
``nn.Linear``'s own.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn


class KernelSource(Protocol):
    def enabled(self) -> bool:
        """Whether one-row products will try the kernel (cheap: nothing built)."""

    def get(self, width: int | None = None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The kernel ``(x (1, in), weight (out, in)) -> (out,)`` for products of ``width`` input features (None:
        any) under this thread count, built on first use; None where it cannot be built."""


_SOURCE: KernelSource | None = None


def install(source: KernelSource | None) -> None:
    """Where one-row products get their kernel (None: ``F.linear`` for every product)."""
    global _SOURCE
    _SOURCE = source


def enabled() -> bool:
    """Whether one-row products will try a kernel: a model loader keeps the weights' row-major layout for it."""
    return _SOURCE is not None and _SOURCE.enabled()


def takes_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``F.linear(x, weight)`` is one float32 row of plain CPU tensors (no subclass, no torch function or
    dispatch mode watching), outside a trace and without gradients."""
    return (not torch.compiler.is_compiling()  # first: a trace reads nothing below (dynamo cannot trace the stacks)
            and type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter) and x.device.type == "cpu"
            and x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 2
            and x.numel() == weight.shape[1] and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and not torch._C._len_torch_function_stack() and not torch._C._len_torch_dispatch_stack())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on the installed kernel where :func:`takes_kernel` says so."""
    if _SOURCE is not None and takes_kernel(x, weight):
        kernel = _SOURCE.get(weight.shape[1])
        if kernel is not None:
            y = kernel(x.reshape(1, weight.shape[1]).contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
            return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def row_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weight matrices a decoding step multiplies one row by: every ``nn.Linear``'s in module order, then the
    output head (``model.head_weight``)."""
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear)] + [model.head_weight]


class Linear(nn.Linear):
    """``nn.Linear`` whose one-row products go through :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
