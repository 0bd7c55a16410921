"""The analytic size of a KV cache, which every strategy's byte counts are checked against."""

from __future__ import annotations

import torch

from .config import ModelConfig


def kv_bytes(config: ModelConfig, tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes to hold keys and values for ``tokens`` positions of ``batch_size`` sequences:
    ``2 * layers * kv_heads * head_dim * element_size * batch * tokens``."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element * batch_size * tokens
