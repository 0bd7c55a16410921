"""Rotary position embedding (RoPE), in the Hugging Face "rotate half" convention.

Keys are rotated *before* they are written to the cache, so a cached key already carries its position and is
never touched again. The inverse frequencies follow transformers for the ``linear`` and ``llama3`` scalings.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 angular frequencies, after rope scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling.get("original_max_position_embeddings", config.max_position_embeddings))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(torch.nn.Module):
    """Computes cos/sin for a run of positions and rotates q and k with them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def cos_sin(self, pos: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions ``pos .. pos + length - 1``, each ``[length, head_dim]``."""
        t = torch.arange(pos, pos + length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # (T, hd/2), computed in float32 like transformers
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to ``x`` of shape ``(B, heads, T, hd)`` with ``cos``/``sin`` of shape ``(T, hd)``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
