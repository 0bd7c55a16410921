"""llama.cpp's KV cache types (``--cache-type-k`` / ``--cache-type-v``) as torch operations: each row of a head's
vector is cut into blocks of 32 values, and each block is stored as ggml stores it, byte for byte.

=========  =====  ===========================================================  ==============
type       bytes  one block of 32 values                                       bits per value
=========  =====  ===========================================================  ==============
``q8_0``   34     scale ``d`` (float16), 32 signed 8-bit codes                   8.5
``q5_1``   24     ``d``, minimum ``m`` (float16 each), 32 high bits, 16 nibbles  6.0
``q5_0``   22     ``d``, 32 high bits (4 bytes), 16 bytes of low nibbles          5.5
``q4_1``   20     ``d``, ``m``, 16 bytes of nibbles                               5.0
``q4_0``   18     ``d``, 16 bytes of nibbles                                      4.5
``f16``    64     32 float16 values                                              16
``bf16``   64     32 bfloat16 values                                             16
=========  =====  ===========================================================  ==============

The rules are ggml's reference quantizers (``ggml-quants.c``, and the ``gguf`` package's ``gguf.quants``, which
matches them bit for bit), computed in float32:

- ``q8_0``: ``d = max|x| / 127``, ``code = round(x / d)`` (halves away from zero);
- ``q4_0`` / ``q5_0``: ``d = x[argmax |x|] / -8`` (``/ -16``), ``code = trunc(x / d + 8.5)`` (``+ 16.5``), clipped
  to 0..15 (0..31); the value read back is ``d * (code - 8)`` (``- 16``);
- ``q4_1`` / ``q5_1``: ``d = (max - min) / 15`` (``/ 31``), ``code = trunc((x - min) / d + 0.5)``; read back as
  ``d * code + m``.

Nibbles: byte ``j`` of a block's 16 holds value ``j`` in its low four bits and value ``j + 16`` in its high four. The
fifth bit of ``q5`` codes: bit ``j`` of the little-endian 32-bit word holds value ``j``'s. ``d`` and ``m`` are rounded
to float16 when stored (the codes are computed with the float32 ``d``), so a value read back may differ from the input
by a little more than half a step.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per block, for every quantized type
#: bytes of one block of 32 values, by type
BLOCK_BYTES = {"q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18, "f16": 64, "bf16": 64}
TYPES = tuple(BLOCK_BYTES)  # as llama.cpp's --cache-type-k/-v name them
_FLOAT = {"f16": torch.float16, "bf16": torch.bfloat16}
_U8, _F32 = torch.uint8, torch.float32


def row_bytes(ctype: str, width: int) -> int:
    """Bytes one row of ``width`` values takes in cache type ``ctype`` (``width`` a multiple of 32)."""
    return width // BLOCK * BLOCK_BYTES[ctype]


def bits_per_value(ctype: str) -> float:
    """Bits each value costs in cache type ``ctype``, scales and minimums included."""
    return BLOCK_BYTES[ctype] * 8 / BLOCK


def _half_bytes(t: torch.Tensor) -> torch.Tensor:
    """float32 ``(n, 1)`` rounded to float16, as its two little-endian bytes ``(n, 2)``."""
    return t.to(torch.float16).view(_U8)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``(n, 32)`` codes: values 0..15 in the low nibbles, 16..31 in the high ones (16 bytes)."""
    return (codes[:, :16] & 15) | ((codes[:, 16:] & 15) << 4)


def _high_bits(codes: torch.Tensor) -> torch.Tensor:
    """``(n, 32)`` 5-bit codes: their fifth bits as 4 bytes, bit ``j`` of the little-endian word for value ``j``."""
    bits = (codes >> 4).to(torch.int32).view(-1, 4, 8)
    return (bits << torch.arange(8, dtype=torch.int32, device=codes.device)).sum(-1).to(_U8)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """ggml's ``roundf`` as gguf writes it in numpy: ``sign(v) * (floor|v| + floor(2 (|v| - floor|v|)))``."""
    a = v.abs()
    f = a.floor()
    return v.sign() * (f + (2 * (a - f)).floor())


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(-1, keepdim=True) / 127
    return torch.cat([_half_bytes(d), _round_half_away(b * _inverse(d)).to(torch.int8).view(_U8)], -1)


def _symmetric(b: torch.Tensor, top: int) -> torch.Tensor:
    """q4_0 (``top`` 8) and q5_0 (16): ``d`` from the value of largest magnitude, codes offset by ``top``."""
    d = b.gather(-1, b.abs().argmax(-1, keepdim=True)) / -top
    codes = torch.trunc(b * _inverse(d) + (top + 0.5)).to(_U8).clamp_(0, 2 * top - 1)
    return torch.cat([_half_bytes(d)] + ([_high_bits(codes)] if top == 16 else []) + [_nibbles(codes)], -1)


def _affine(b: torch.Tensor, top: int) -> torch.Tensor:
    """q4_1 (``top`` 15) and q5_1 (31): ``d`` and the minimum ``m`` from the block's range."""
    lo, hi = b.amin(-1, keepdim=True), b.amax(-1, keepdim=True)
    d = (hi - lo) / top
    codes = torch.trunc((b - lo) * _inverse(d) + 0.5).to(_U8).clamp_(0, top)
    parts = [_half_bytes(d), _half_bytes(lo)] + ([_high_bits(codes)] if top == 31 else []) + [_nibbles(codes)]
    return torch.cat(parts, -1)


def _codes(b: torch.Tensor, fifth_bit_at: int | None) -> torch.Tensor:
    """The ``(n, 32)`` codes of blocks ``b``: nibbles (last 16 bytes), q5's fifth bits (4 bytes at ``fifth_bit_at``)."""
    low = b[:, -16:]
    codes = torch.cat([low & 15, low >> 4], -1)
    if fifth_bit_at is not None:
        word = b[:, fifth_bit_at:fifth_bit_at + 4].to(torch.int32)
        word = word[:, 0] | (word[:, 1] << 8) | (word[:, 2] << 16) | (word[:, 3] << 24)
        codes = codes | (((word[:, None] >> torch.arange(32, dtype=torch.int32, device=b.device)) & 1).to(_U8) << 4)
    return codes


def _scale(b: torch.Tensor, at: int = 0) -> torch.Tensor:
    return b[:, at:at + 2].contiguous().view(torch.float16).to(_F32)


def _dq8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).to(_F32) * _scale(b)


def _dsymmetric(b: torch.Tensor, top: int) -> torch.Tensor:
    return _scale(b) * (_codes(b, 2 if top == 16 else None).to(torch.int8) - top).to(_F32)


def _daffine(b: torch.Tensor, top: int) -> torch.Tensor:
    return _scale(b) * _codes(b, 4 if top == 31 else None).to(_F32) + _scale(b, 2)


_QUANTIZE = {"q8_0": _q8_0, "q5_1": lambda b: _affine(b, 31), "q5_0": lambda b: _symmetric(b, 16),
             "q4_1": lambda b: _affine(b, 15), "q4_0": lambda b: _symmetric(b, 8)}
_DEQUANTIZE = {"q8_0": _dq8_0, "q5_1": lambda b: _daffine(b, 31), "q5_0": lambda b: _dsymmetric(b, 16),
               "q4_1": lambda b: _daffine(b, 15), "q4_0": lambda b: _dsymmetric(b, 8)}


def quantize(x: torch.Tensor, ctype: str) -> torch.Tensor:
    """``x`` ``(..., width)`` (a multiple of 32) as ``ctype`` blocks: uint8 ``(..., row_bytes(ctype, width))``."""
    *lead, width = x.shape
    if ctype in _FLOAT:
        return x.to(_FLOAT[ctype]).contiguous().view(_U8).view(*lead, row_bytes(ctype, width))
    return _QUANTIZE[ctype](x.to(_F32).reshape(-1, BLOCK)).view(*lead, row_bytes(ctype, width))


def dequantize(blocks: torch.Tensor, ctype: str) -> torch.Tensor:
    """float32 ``(..., width)`` from :func:`quantize`'s ``(..., row_bytes)`` blocks of cache type ``ctype``."""
    *lead, nbytes = blocks.shape
    width = nbytes // BLOCK_BYTES[ctype] * BLOCK
    if ctype in _FLOAT:
        return blocks.contiguous().view(_FLOAT[ctype]).to(_F32).view(*lead, width)
    return _DEQUANTIZE[ctype](blocks.reshape(-1, BLOCK_BYTES[ctype])).view(*lead, width)
