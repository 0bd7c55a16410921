"""llama.cpp's quantized KV cache: keys and values stored as ggml blocks of the types ``--cache-type-k`` and
``--cache-type-v`` take (``make_cache("quantized", model, k_type="q4_0", v_type="q8_0")``; the block formats are
:mod:`kvexplore.caches.ggml_blocks`)."""

from __future__ import annotations

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ...core.settings import choice, positive_int
from ..inspector import Inspector
from ..base import KVCache
from ..ggml_blocks import TYPES, bits_per_value, dequantize, quantize
from ..layers.ggml_layer import GGMLLayer
from ..lossy import LossyStorage


class GGMLCache(KVCache):
    """Per full layer, every position's key row as ``k_type`` blocks and its value row as ``v_type`` blocks, in storage
    allocated once (``[batch, kv_heads, max_seq_len, row bytes]`` of uint8 each; :class:`GGMLLayer`). As llama.cpp does,
    a row is quantized when it is written (no full-precision window) and read back dequantized; the blocks are byte for
    byte what ``gguf.quants.quantize`` makes (bytes per row: docs/strategies.md)."""

    kind = "quantized"

    @property
    def inspect(self) -> "GGMLInspector":
        return GGMLInspector(self)

    def __init__(self, config: ModelConfig, max_seq_len: int, k_type: str = "f16", v_type: str = "f16",
                 batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None) -> None:
        max_seq_len = positive_int(max_seq_len, "max_seq_len")
        self.k_type = choice(k_type, "k_type (llama.cpp's --cache-type-k)", TYPES)
        self.v_type = choice(v_type, "v_type (llama.cpp's --cache-type-v)", TYPES)
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self._capacity = max_seq_len
        self._build()

    def refuses(self, spec: LayerSpec) -> str | None:
        return GGMLLayer.refuses(spec)

    def full_layer(self, spec: LayerSpec) -> GGMLLayer:
        return GGMLLayer(spec, self.batch_size, self.dtype, self.device, self._capacity, self.k_type, self.v_type)

    @property
    def quantization(self) -> "GGMLStorage":
        return GGMLStorage(self)

    def blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s stored key and value blocks (uint8 ``[batch, kv_heads, max_seq_len, row bytes]``), live."""
        target = self.layers[layer]
        return target.k, target.v


class GGMLStorage(LossyStorage):
    """llama.cpp's cache types as lossy storage: no record of the originals (the doctor measures the error against
    the model's own keys), and the bound of the block types."""

    def channel_error(self, layer: int) -> None:
        return None

    def channel_detail(self, layer: int) -> None:
        return None

    def error_bound(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """What storing ``keys`` and ``values`` in these block types changes, element by element (quantizing and
        reading back the model's own rows), with float32's rounding on top (an f16 or bf16 type: the rounding to
        that format); None for a layer the cache does not store in blocks."""
        if layer not in self.cache.full_layers:
            return None

        def bound(x: torch.Tensor, ctype: str) -> torch.Tensor:
            x = x.float()
            return (dequantize(quantize(x, ctype), ctype) - x).abs() + 1e-6 * x.abs().amax().clamp_min(1)

        return bound(keys, self.cache.k_type), bound(values, self.cache.v_type)


class GGMLInspector(Inspector):
    """What a llama.cpp-typed cache can say about itself: what it did to the sequence so far."""

    def what_it_did(self) -> str:
        cache = self.cache
        return (f"llama.cpp cache types: keys {cache.k_type} ({bits_per_value(cache.k_type):g} bits a value), values "
                f"{cache.v_type} ({bits_per_value(cache.v_type):g} bits a value); all {cache.length} positions stored "
                f"quantized as they were written")
