"""KIVI's quantization: asymmetric min/max codes for keys (per channel, over blocks of tokens) and values (per token,
over groups of channels), keys and values each at 2, 3, 4 or 8 bits, bit-packed (:func:`pack`).

``code = round((x - zero) / scale)`` with ``zero = min`` and ``scale = (max - min) / (2**bits - 1)``, so ``|x -
dequant(code)| <= scale / 2`` for every element. Codes are packed into ``uint8`` along head_dim (two 4-bit codes a byte,
four 2-bit codes, eight 3-bit codes in three bytes). Scales and zeros are float32, in tensors of their own."""

from __future__ import annotations

import torch

F32 = torch.float32


def _minmax(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, unpacked), scale and zero of float32 ``x`` quantized over ``dim`` (kept as size 1)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / (2 ** bits - 1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code is 0, exact
    return ((x - lo) / safe).round_().clamp_(0, 2 ** bits - 1).to(torch.uint8), scale, lo


BITS = (2, 3, 4, 8)  # the code widths: packed 4, 8 per 3 bytes, 2, and 1 per byte


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes packed along the last dim: ``(..., D) -> (..., D * bits // 8)`` uint8. 8 bits as they are; 4 bits two
    per byte (code ``2i`` in the low nibble); 2 bits four per byte (code ``4i + j`` at bits ``2j``); 3 bits eight
    codes in three bytes (code ``8i + j`` at bits ``3j`` of the little-endian 24-bit word)."""
    if bits == 8:
        return q
    if bits == 3:
        word = (q.view(*q.shape[:-1], -1, 8).to(torch.int32) << torch.arange(0, 24, 3, device=q.device)).sum(-1)
        return torch.stack([(word >> s) & 255 for s in (0, 8, 16)], -1).flatten(-2).to(torch.uint8)
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=q.device)
    return (q.view(*q.shape[:-1], -1, per) << shifts).sum(-1, dtype=torch.uint8)


def unpack(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``(..., D * bits // 8) -> (..., D)`` uint8 codes."""
    if bits == 8:
        return p
    # shifts by a Python number, one code of each byte (word) at a time: a shift by a tensor of shifts broadcast over
    # the codes runs 3x slower on the CPU, and this is every quantized layer's read at every step
    if bits == 3:
        b = p.view(*p.shape[:-1], -1, 3).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        return torch.stack([(word >> s) & 7 for s in range(0, 24, 3)], -1).flatten(-2).to(torch.uint8)
    mask = 2 ** bits - 1
    return torch.stack([p & mask, *((p >> s) & mask for s in range(bits, 8 - bits, bits)), p >> (8 - bits)],
                       -1).flatten(-2)


# what one scale covers: a channel over a block of tokens, or a group of one token's channels
AXES = ("channel", "token")


def quantize(x: torch.Tensor, bits: int, axis: str, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``(B, H, T, D)`` -> packed codes ``(B, H, T, D * bits // 8)``, scale and zero. ``axis="channel"``: one
    scale per channel over each block of ``group`` tokens (``T`` a multiple of it), scale and zero ``(B, H, T // group,
    D)`` (KIVI's keys); ``axis="token"``: one scale per token over each group of ``group`` channels, ``(B, H, T,
    D // group)`` (KIVI's values)."""
    g, dim = _groups(x, axis, group)
    q, s, z = _minmax(g, dim, bits)
    return pack(q.view(x.shape), bits), s.squeeze(dim), z.squeeze(dim)


def _groups(x: torch.Tensor, axis: str, group: int) -> tuple[torch.Tensor, int]:
    """Float32 ``x`` ``(B, H, T, D)`` viewed with each scale's group along one dim, and that dim."""
    B, H, T, D = x.shape
    x = x.to(F32)
    if axis == "channel":
        return x.reshape(B, H, T // group, group, D), 3
    return x.reshape(B, H, T, D // group, group), 4


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, axis: str) -> torch.Tensor:
    """Float32 ``(B, H, T, D)`` from :func:`quantize`'s output (the group is read from the shapes)."""
    q = unpack(codes, bits).to(F32)
    B, H, T, D = q.shape
    if axis == "channel":
        n = scale.shape[2]
        return (q.view(B, H, n, T // n, D) * scale.unsqueeze(3) + zero.unsqueeze(3)).view(B, H, T, D)
    g = scale.shape[3]
    return (q.view(B, H, T, g, D // g) * scale.unsqueeze(4) + zero.unsqueeze(4)).view(B, H, T, D)


def steps(x: torch.Tensor, bits: int, axis: str, group: int) -> torch.Tensor:
    """The quantization step of each element's group, ``(B, H, T, D)``: an element is read back within half of it."""
    g, dim = _groups(x, axis, group)
    return ((g.amax(dim, keepdim=True) - g.amin(dim, keepdim=True)) / (2 ** bits - 1)).expand(g.shape).reshape(x.shape)


def quantize_keys(k: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI's keys: :func:`quantize` per channel over blocks of ``group_size`` tokens."""
    return quantize(k, bits, "channel", group_size)


def dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize(codes, scale, zero, bits, "channel")


def quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI's values: :func:`quantize` per token over groups of ``group`` channels."""
    return quantize(v, bits, "token", group)


def dequantize_values(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    return dequantize(codes, scale, zero, bits, "token")
