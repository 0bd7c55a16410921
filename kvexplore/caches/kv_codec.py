"""How the quantized cache encodes one part of a position, its key or its value: transforms, then KIVI's codes. Before
the codes, in this order (each undone in reverse at read): pre-RoPE keys (KVQuant: turned back to position 0, where a
key's large channels stay the same from token to token), a Hadamard rotation (QuaRot: blocks of the largest power of two
dividing head_dim, spreading a few large channels over all; its own inverse), outliers (KVQuant's dense-and-sparse: each
vector's ``n`` largest magnitudes kept exact and replaced by 0 for the quantizer), then ``bits``-bit min/max codes along
``axis`` (:mod:`.kivi`). docs/strategies.md has the options."""

from __future__ import annotations

import math

import torch

from .kivi import F32, dequantize, quantize, steps


def hadamard(dim: int, block: int) -> torch.Tensor:
    """The orthonormal ``(dim, dim)`` float32 block-diagonal matrix of ``dim // block`` Sylvester Hadamard blocks of
    ``block`` (a power of two): symmetric, and its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / math.sqrt(block)] * (dim // block))


def hadamard_block(dim: int) -> int:
    """The largest power of two dividing ``dim`` (the rotation's block)."""
    return dim & -dim


class Codec:
    """The scheme of one part: ``bits``, ``axis``, ``group`` (tokens a channel's scale covers, or channels a token's
    scale covers), ``rotation`` (a Hadamard matrix or None), ``outliers`` (entries of each vector kept exact),
    ``pre_rope`` (keys only: quantized before the rotary embedding)."""

    __slots__ = ("bits", "axis", "group", "rotation", "outliers", "pre_rope")

    def __init__(self, bits: int, axis: str, group: int, rotation: torch.Tensor | None, outliers: int,
                 pre_rope: bool) -> None:
        self.bits, self.axis, self.group, self.rotation = bits, axis, group, rotation
        self.outliers, self.pre_rope = outliers, pre_rope

    def scale_shape(self, batch: int, heads: int, slots: int, dim: int) -> tuple[int, int, int, int]:
        """The shape of the scale (and zero) tensor for ``slots`` positions (whole blocks of the group)."""
        if self.axis == "channel":
            return batch, heads, slots // self.group, dim
        return batch, heads, slots, dim // self.group

    def scale_rows(self, start: int, end: int) -> slice:
        """The rows of the scale tensor that positions ``start..end-1`` use (whole blocks on the channel axis)."""
        return slice(start // self.group, end // self.group) if self.axis == "channel" else slice(start, end)

    def transform(self, x: torch.Tensor, positions: torch.Tensor, turn) -> torch.Tensor:
        """``x`` ``(B, H, T, D)`` at ``positions`` ``(T,)`` to the domain the codes are taken in (float32)."""
        y = x.to(F32)
        if self.pre_rope:
            y = turn(y, -positions)
        if self.rotation is not None:
            y = y @ self.rotation.to(y.device)
        return y

    def untransform(self, y: torch.Tensor, positions: torch.Tensor, turn) -> torch.Tensor:
        if self.rotation is not None:
            y = y @ self.rotation.to(y.device)
        if self.pre_rope:
            y = turn(y, positions)
        return y

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``y`` without its outliers (0 in their place), their channel indices and their values."""
        if not self.outliers:
            return y, None, None
        idx = y.abs().topk(self.outliers, -1).indices
        return y.scatter(-1, idx, 0.0), idx, y.gather(-1, idx)

    def encode(self, x: torch.Tensor, positions: torch.Tensor, turn, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The stored tensors of ``x`` ``(B, H, T, D)``: ``codes``, ``scale``, ``zero``, and with outliers ``out_idx``
        (int16 channel indices) and ``out_val`` (in ``dtype``, the cache's full precision)."""
        y, idx, val = self.split(self.transform(x, positions, turn))
        codes, scale, zero = quantize(y, self.bits, self.axis, self.group)
        out = {"codes": codes, "scale": scale, "zero": zero}
        if idx is not None:
            out["out_idx"], out["out_val"] = idx.to(torch.int16), val.to(dtype)
        return out

    @property
    def transforms(self) -> bool:
        """Whether the codes are taken somewhere else than in the model's own channels (pre-RoPE, rotated)."""
        return self.pre_rope or self.rotation is not None

    def decoded(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        """Float32 ``(B, H, T, D)`` from :meth:`encode`'s tensors where the codes are taken (before
        :meth:`untransform`): the codes scaled, the outliers put back."""
        y = dequantize(stored["codes"], stored["scale"], stored["zero"], self.bits, self.axis)
        if self.outliers:
            y = y.scatter(-1, stored["out_idx"].long(), stored["out_val"].to(F32))
        return y

    def decode(self, stored: dict[str, torch.Tensor], positions: torch.Tensor, turn) -> torch.Tensor:
        """Float32 ``(B, H, T, D)`` from :meth:`encode`'s tensors (or views of the cache's storage)."""
        return self.untransform(self.decoded(stored), positions, turn)

    def bound(self, x: torch.Tensor, positions: torch.Tensor, turn) -> torch.Tensor:
        """How far each element of ``x`` ``(B, H, T, D)`` (whole blocks) may be read back from itself: half a step of
        its group where codes are taken in the model's own channels; through a rotation (pre-RoPE, Hadamard), the
        length of the vector of those half steps, which bounds every element of the rotated-back error."""
        y, idx, _ = self.split(self.transform(x, positions, turn))
        half = steps(y, self.bits, self.axis, self.group) / 2
        if idx is not None:
            half = half.scatter(-1, idx, 0.0)
        if self.rotation is None and not self.pre_rope:
            return half
        return half.square().sum(-1, keepdim=True).sqrt().expand_as(half)

    def bits_per_value(self, dim: int, itemsize: int) -> float:
        """Bits a stored element costs: its code, its share of a float32 scale and zero, and of the outliers (an
        int16 index and a value in the cache's dtype each)."""
        return self.bits + 2 * 32 / self.group + self.outliers * (16 + 8 * itemsize) / dim
