"""The hook points' one helper: pass a tensor to a tracer and take back what it returns (a replacement or None)."""

from __future__ import annotations

from typing import Any

import torch


def hook(tracer: Any, name: str, t: torch.Tensor) -> torch.Tensor:
    replaced = tracer.hook(name, t)
    return t if replaced is None else replaced
