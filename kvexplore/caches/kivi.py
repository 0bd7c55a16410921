"""KIVI's quantization: asymmetric min/max codes for keys (per channel, over blocks of tokens) and values (per token,
over groups of channels), packed two per byte at 4 bits.

``code = round((x - zero) / scale)`` with ``zero = min`` and ``scale = (max - min) / (2**bits - 1)``, so
``|x - dequant(code)| <= scale / 2`` for every element. Codes are ``uint8``; 4-bit codes are packed two per byte
along head_dim (channel ``2i`` in the low nibble, ``2i + 1`` in the high one). Scales and zeros are float32.
"""

from __future__ import annotations

import torch

F32 = torch.float32


def _minmax(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, unpacked), scale and zero of float32 ``x`` quantized over ``dim`` (kept as size 1)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code is 0, exact
    return ((x - lo) / safe).round_().clamp_(0, 2 ** bits - 1).to(torch.uint8), scale, lo


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """8-bit codes as they are; 4-bit codes two per byte along the last dim: ``(..., D) -> (..., D // 2)``."""
    return q if bits == 8 else q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., D * bits // 8) -> (..., D)`` uint8 codes."""
    return p if bits == 8 else torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys ``(B, H, n * G, D)``, per channel over blocks of ``G`` tokens -> packed codes ``(B, H, n * G,
    D * bits // 8)``, scale and zero ``(B, H, n, D)``."""
    B, H, T, D = k.shape
    q, s, z = _minmax(k.to(F32).reshape(B, H, T // group_size, group_size, D), 3, bits)
    return pack(q.view(B, H, T, D), bits), s.squeeze(3), z.squeeze(3)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 keys ``(B, H, n * G, D)`` from :func:`quantize_keys` output."""
    B, H, n, D = scale.shape
    q = unpack(codes, bits).view(B, H, n, -1, D).to(F32)  # (B, H, n, G, D)
    return (q * scale.unsqueeze(3) + zero.unsqueeze(3)).view(B, H, -1, D)


def quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values ``(B, H, T, D)``, per token over groups of ``group`` channels -> packed codes ``(B, H, T,
    D * bits // 8)``, scale and zero ``(B, H, T, D // group)``."""
    B, H, T, D = v.shape
    q, s, z = _minmax(v.to(F32).reshape(B, H, T, D // group, group), 4, bits)
    return pack(q.view(B, H, T, D), bits), s.squeeze(4), z.squeeze(4)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Float32 values ``(B, H, T, D)`` from :func:`quantize_values` output."""
    B, H, T, g = scale.shape
    q = unpack(codes, bits).view(B, H, T, g, -1).to(F32)  # (B, H, T, groups, group)
    return (q * scale.unsqueeze(4) + zero.unsqueeze(4)).view(B, H, T, -1)
