"""A full layer stored as llama.cpp stores its KV cache: each position's key and value rows as blocks of one of ggml's
cache types (:mod:`kvexplore.caches.ggml_blocks`), written in place and read back dequantized."""

from __future__ import annotations

import torch

from ..ggml_blocks import dequantize, quantize, row_bytes
from ..layer import Step
from .preallocated_layer import PreallocatedLayer


class GGMLLayer(PreallocatedLayer):
    """``k``/``v``: uint8 ``[batch, kv_heads, capacity, row bytes]``, one row of ggml blocks per position (a key
    row of ``k_type``, a value row of ``v_type``). A write quantizes the new rows into their slots (the undo
    journal keeps the slots it overwrites, as the pre-allocated layer does); attention reads every held position
    dequantized to the cache's dtype (a copy: the storage holds codes)."""

    def __init__(self, spec, batch_size: int, dtype: torch.dtype, device: torch.device, capacity: int,
                 k_type: str, v_type: str) -> None:
        self.k_type, self.v_type = k_type, v_type
        super().__init__(spec, batch_size, dtype, device, capacity)

    @classmethod
    def refuses(cls, spec) -> str | None:
        if spec.latent:
            return ("llama.cpp's cache types store keys and values of one width; an MLA model's latent cache "
                    "(DeepSeek) stores a latent and a rope key instead: use preallocated, concat, paged or none")
        bad = [w for w in (spec.head_dim, spec.value_width) if w % 32]
        if bad:
            return (f"llama.cpp's cache types quantize rows in blocks of 32 values, and this layer's rows are "
                    f"{bad[0]} wide: use bits=4 or 8 (KIVI's groups) or another cache kind")
        return None

    def zeros(self, slots: int, values: bool = False) -> torch.Tensor:
        ctype, width = (self.v_type, self._widths[1]) if values else (self.k_type, self._widths[0])
        return torch.zeros((self._batch, self.spec.kv_heads, slots, row_bytes(ctype, width)), dtype=torch.uint8,
                           device=self.device)

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos, q_len = step.pos, k.shape[2]
        kq, vq = quantize(k, self.k_type), quantize(v, self.v_type)  # before anything changes: a bad row raises
        self.prepare(step, pos, q_len)
        self.k.narrow(2, pos, q_len).copy_(kq)
        self.v.narrow(2, pos, q_len).copy_(vq)
        return self.read_upto(pos + q_len)

    def read_upto(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``0..end-1``, dequantized, in the cache's dtype."""
        return (dequantize(self.k.narrow(2, 0, end), self.k_type).to(self._dtype),
                dequantize(self.v.narrow(2, 0, end), self.v_type).to(self._dtype))

    def _used_bytes(self, length: int) -> int:
        """The blocks of the positions held: ``length`` rows of keys and of values, every head and batch row."""
        return (self.k.shape[3] + self.v.shape[3]) * self._batch * self.spec.kv_heads * self._held(length)

    def stored_error(self, length: int) -> torch.Tensor | None:
        return None  # the originals are not kept; the doctor measures the error against the model's own keys

