"""A reference for the quantized cache's schemes, written apart from it: a pre-allocated cache that, when a block of
positions leaves the full-precision window, overwrites those keys and values in its own float storage with their
quantize-then-dequantize (fake quantization). No packing, no stored codes or scales: what the quantized cache reads
back must equal what this one holds.

Each transform is written the plain way: RoPE undone with the model's cos and sin (x cos - rotate_half(x) sin),
the Hadamard matrix built as a Kronecker power, outliers as the top magnitudes of each vector, the groups' min/max
codes with ``torch.round``.
"""

from __future__ import annotations

import math

import torch

from kvexplore.caches.strategies.preallocated import PreallocatedCache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, back: bool) -> torch.Tensor:
    """RoPE (``back``: its inverse) on the first ``cos.shape[-1]`` channels of ``x`` ``(B, H, T, D)``."""
    rot = cos.shape[-1]
    head, tail = x[..., :rot], x[..., rot:]
    turned = head * cos + _rotate_half(head) * (-sin if back else sin)
    return torch.cat([turned, tail], -1)


def _hadamard(dim: int) -> torch.Tensor:
    block = dim & -dim
    h = torch.tensor([[1.0]])
    while h.shape[0] < block:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    return torch.kron(torch.eye(dim // block), h) / math.sqrt(block)


def _fake_quant(y: torch.Tensor, bits: int, axis: str, group: int) -> torch.Tensor:
    """``y`` ``(B, H, T, D)`` through min/max codes of ``bits``: per channel over blocks of ``group`` tokens, or per
    token over groups of ``group`` channels."""
    B, H, T, D = y.shape
    out = torch.empty_like(y)
    top = 2 ** bits - 1
    if axis == "channel":
        for t0 in range(0, T, group):
            g = y[:, :, t0:t0 + group]
            lo, hi = g.amin(2, keepdim=True), g.amax(2, keepdim=True)
            scale = (hi - lo) / top
            codes = torch.where(scale > 0, ((g - lo) / torch.where(scale > 0, scale, 1)).round().clamp(0, top), 0)
            out[:, :, t0:t0 + group] = codes * scale + lo
    else:
        for c0 in range(0, D, group):
            g = y[..., c0:c0 + group]
            lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
            scale = (hi - lo) / top
            codes = torch.where(scale > 0, ((g - lo) / torch.where(scale > 0, scale, 1)).round().clamp(0, top), 0)
            out[..., c0:c0 + group] = codes * scale + lo
    return out


class FakeQuantCache(PreallocatedCache):
    """What :class:`~kvexplore.caches.strategies.quantized.QuantizedCache` with the same options must read, held in
    float."""

    def __init__(self, model, max_seq_len: int, key_bits: int = 8, value_bits: int = 8, group_size: int = 32,
                 residual: int = 32, key_axis: str = "channel", value_axis: str = "token", rotate=None,
                 pre_rope_keys: bool = False, outliers: float = 0.0, exact_prefill: bool = False) -> None:
        super().__init__(model.config, max_seq_len)
        self.model, self.G, self.R, self.nq = model, group_size, residual, max_seq_len // group_size * group_size
        self.parts = ((key_bits, key_axis, pre_rope_keys), (value_bits, value_axis, False))
        self.rotate, self.outliers, self.exact_prefill = rotate, outliers, exact_prefill
        self.frontier = {i: 0 for i in self.full_layers}

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor, queries=None):
        keys, values = super().write(layer, pos, k, v, queries)
        if layer in self.frontier:
            end = pos + k.shape[2]
            old = self.frontier[layer]
            new = min(self.nq, max(old, (end - self.R) // self.G * self.G))
            if new > old:
                if pos == 0 and self.exact_prefill:  # the prompt reads what it computed; storage gets the codes
                    read = keys.clone(), values.clone()
                for x, (bits, axis, pre_rope) in zip((keys, values), self.parts):
                    x[:, :, old:new] = self._qdq(x[:, :, old:new], old, bits, axis, pre_rope, layer)
                self.frontier[layer] = new
                if pos == 0 and self.exact_prefill:
                    return read
        return keys, values

    def _qdq(self, x: torch.Tensor, start: int, bits: int, axis: str, pre_rope: bool, layer: int) -> torch.Tensor:
        D = x.shape[-1]
        y = x.float()
        if pre_rope:
            cos, sin = self.model.rotary.cos_sin(start, x.shape[2], torch.float32,
                                                 self.model.config.layer_types[layer])
            y = _turn(y, cos, sin, back=True)
        h = _hadamard(D) if self.rotate else None
        if h is not None:
            y = y @ h
        n = math.ceil(self.outliers * D)
        if n:
            idx = y.abs().topk(n, -1).indices
            kept = y.gather(-1, idx)
            y = _fake_quant(y.scatter(-1, idx, 0.0), bits, axis, self.G if axis == "channel" else min(self.G, D))
            y = y.scatter(-1, idx, kept)
        else:
            y = _fake_quant(y, bits, axis, self.G if axis == "channel" else min(self.G, D))
        if h is not None:
            y = y @ h
        if pre_rope:
            y = _turn(y, cos, sin, back=False)
        return y.to(x.dtype)


def teacher_forced_logits(model, cache, ids: list[int], prompt: int) -> torch.Tensor:
    """The logits of a prefill of ``ids[:prompt]`` (its last row) and of each later token fed one at a time."""
    with torch.no_grad():
        rows = [model(torch.tensor([ids[:prompt]]), cache, 0)[0, -1]]
        for p in range(prompt, len(ids)):
            rows.append(model(torch.tensor([[ids[p]]]), cache, p)[0, -1])
    return torch.stack(rows).float()

