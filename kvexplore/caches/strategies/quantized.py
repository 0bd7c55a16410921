"""KIVI: keys quantized per channel, values per token, the newest tokens kept in full precision; or, given
``k_type`` / ``v_type``, llama.cpp's cache types (:mod:`kvexplore.caches.strategies.ggml`).

The quantization is :mod:`kvexplore.caches.kivi` (re-exported here); one layer's storage is
:class:`~kvexplore.caches.layers.quantized_layer.QuantizedLayer`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...config.layer_plan import LayerSpec
from ...config.model_config import ModelConfig
from ...core.settings import integer
from ...errors import SettingsError
from ..base import KVCache
from ..ggml_blocks import TYPES
from ..inspector import Inspector
from ..options import Flag, Options, count, maybe, one_of, option, positive, switch
from .ggml import GGMLCache
from ..layers.quantized_layer import QuantizedLayer
from ..memory import StepCounters
from ..kivi import AXES, BITS, F32, dequantize_keys, dequantize_values, pack, quantize_keys, quantize_values, unpack
from ..kv_codec import Codec, hadamard, hadamard_block
from ..lossy import LossyStorage

__all__ = ["AXES", "BITS", "F32", "QuantizedCache", "dequantize_keys", "dequantize_values", "pack", "quantize_keys",
           "quantize_values", "unpack"]


def _bits(value: Any, name: str) -> int | None:
    if value is not None and integer(value, name) not in BITS:
        raise SettingsError(f"{name} must be one of {', '.join(map(str, BITS))}, got {value}")
    return value


def _axis(value: Any, name: str) -> str | None:
    if value is not None and value not in AXES:
        raise SettingsError(f"{name} must be 'channel' (a scale per channel over a block of group_size tokens) "
                            f"or 'token' (a scale per token over groups of channels), got {value!r}")
    return value


def _rotate(value: Any, name: str) -> str | None:
    if value not in (None, "hadamard"):
        raise SettingsError(f"rotate must be None or 'hadamard', got {value!r}")
    return value


def _outliers(value: Any, name: str) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 0.5):
        raise SettingsError(f"outliers is the fraction of each vector's entries kept exact, from 0 up to (not "
                            f"including) 0.5 (KVQuant keeps 0.01), got {value!r}")
    return value


@dataclass(frozen=True)
class QuantizedOptions(Options):
    """KIVI's options (None: not given, the default), or llama.cpp's cache types (``k_type``, ``v_type``)."""

    max_seq_len: int = option(help="positions each layer holds", check=positive, flag=None)
    bits: int | None = option(None, help="bits per value, keys and values (default 8)", check=_bits,
                              flag=Flag(int, BITS))
    group_size: int | None = option(None, help="positions per quantized block (default 32)", check=maybe(positive),
                                    flag=Flag(int))
    residual: int | None = option(None, help="the newest positions kept in full precision (default 32)",
                                  check=maybe(count), flag=Flag(int))
    k_type: str | None = option(None, help="llama.cpp's key cache type (ggml blocks; the values default to f16)",
                                check=maybe(one_of(TYPES, "k_type (llama.cpp's --cache-type-k)")),
                                flag=Flag(str, TYPES, name="--cache-type-k"))
    v_type: str | None = option(None, help="llama.cpp's value cache type (the keys default to f16)",
                                check=maybe(one_of(TYPES, "v_type (llama.cpp's --cache-type-v)")),
                                flag=Flag(str, TYPES, name="--cache-type-v"))
    key_bits: int | None = option(None, help="the keys' bits (default: bits)", check=_bits, flag=Flag(int, BITS))
    value_bits: int | None = option(None, help="the values' bits (default: bits)", check=_bits, flag=Flag(int, BITS))
    key_axis: str | None = option(None, help="a key scale per channel over a block (default) or per token",
                                  check=_axis, flag=Flag(str, AXES))
    value_axis: str | None = option(None, help="a value scale per token (default) or per channel over a block",
                                    check=_axis, flag=Flag(str, AXES))
    rotate: str | None = option(None, help="rotate each head's vectors before quantizing (QuaRot's idea)",
                                check=_rotate,
                                flag=Flag(str, ("hadamard",)))
    pre_rope_keys: bool | None = option(None, help="quantize keys before RoPE, rotate them at read (KVQuant)",
                                        check=switch, flag=Flag(switch=True))
    outliers: float | None = option(None, help="the fraction of each vector kept exact (KVQuant: 0.01)",
                                    check=_outliers, flag=Flag(float))
    exact_prefill: bool | None = option(None, help="the prompt's own pass reads its keys and values as computed "
                                                   "(KIVI's and transformers' prefill); the codes are stored all the "
                                                   "same", check=switch, flag=Flag(switch=True))

    @property
    def ggml(self) -> bool:
        """llama.cpp's cache types (a :class:`~kvexplore.caches.strategies.ggml.GGMLCache`), not KIVI's."""
        return self.k_type is not None or self.v_type is not None

    def validate(self) -> None:
        kivi_only = [name for name in self.names() if name not in ("max_seq_len", "k_type", "v_type")
                     and getattr(self, name) is not None]
        if self.ggml and kivi_only:
            raise SettingsError(f"k_type / v_type choose llama.cpp's cache types, which fix their own blocks (32 "
                                f"values, scales inside) and keep no full-precision window: leave out {kivi_only}, "
                                f"or leave out k_type and v_type for KIVI's cache")


class QuantizedCache(KVCache):
    """KIVI cache: positions ``0..Q-1`` quantized, ``Q..length-1`` in full precision (the residual). How ``Q`` moves,
    the storage per layer, a rewind into a quantized block: docs/strategies.md ("The quantized cache")."""

    def __new__(cls, config: ModelConfig, max_seq_len: int, bits: int | None = None, group_size: int | None = None,
                residual: int | None = None, batch_size: int = 1, dtype: torch.dtype | None = None,
                device: str | torch.device | None = None, k_type: str | None = None, v_type: str | None = None,
                key_bits: int | None = None, value_bits: int | None = None, key_axis: str | None = None,
                value_axis: str | None = None, rotate: str | None = None, pre_rope_keys: bool | None = None,
                outliers: float | None = None, exact_prefill: bool | None = None):
        """With ``k_type`` or ``v_type`` (llama.cpp's cache types: q8_0, q5_1, q5_0, q4_1, q4_0, f16, bf16; the
        one not given is f16, llama.cpp's default), a :class:`~kvexplore.caches.strategies.ggml.GGMLCache`: every
        row stored as ggml blocks; otherwise KIVI's cache (this class)."""
        if k_type is None and v_type is None:
            return super().__new__(cls)
        options = QuantizedOptions(max_seq_len, bits, group_size, residual, k_type, v_type, key_bits, value_bits,
                                   key_axis, value_axis, rotate, pre_rope_keys, outliers, exact_prefill)
        cache = GGMLCache(config, max_seq_len, k_type or "f16", v_type or "f16", batch_size, dtype, device)
        cache.options = options
        return cache

    kind = "quantized"
    Options = QuantizedOptions

    @property
    def inspect(self) -> "QuantizedInspector":
        return QuantizedInspector(self)

    def __init__(self, config: ModelConfig, max_seq_len: int, bits: int | None = None, group_size: int | None = None,
                 residual: int | None = None, batch_size: int = 1, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, k_type: None = None, v_type: None = None,
                 key_bits: int | None = None, value_bits: int | None = None, key_axis: str | None = None,
                 value_axis: str | None = None, rotate: str | None = None, pre_rope_keys: bool | None = None,
                 outliers: float | None = None, exact_prefill: bool | None = None) -> None:
        self.options = o = self.Options(max_seq_len, bits, group_size, residual, k_type, v_type, key_bits,
                                        value_bits, key_axis, value_axis, rotate, pre_rope_keys, outliers,
                                        exact_prefill)
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        bits = 8 if o.bits is None else o.bits
        self.key_bits = bits if o.key_bits is None else o.key_bits
        self.value_bits = bits if o.value_bits is None else o.value_bits
        self.group_size = 32 if o.group_size is None else o.group_size
        self.residual = 32 if o.residual is None else o.residual
        self.key_axis, self.value_axis, self.rotate = o.key_axis or "channel", o.value_axis or "token", o.rotate
        self.pre_rope_keys, self.outliers = bool(o.pre_rope_keys), float(o.outliers or 0.0)
        self.exact_prefill = bool(o.exact_prefill)  # the prompt's own pass reads it as computed (KIVI's, transformers')
        self._capacity = o.max_seq_len
        self._rotations: dict[int, torch.Tensor] = {}  # one Hadamard matrix per head width, shared by the layers
        self._build()

    def refuses(self, spec: LayerSpec) -> str | None:
        if why := QuantizedLayer.refuses(spec):
            return why
        for part, D, axis in (("keys", spec.head_dim, self.key_axis), ("values", spec.value_width, self.value_axis)):
            if axis == "token" and D % min(self.group_size, D):
                return (f"head_dim {D} must be a multiple of the {part}' group of channels {min(self.group_size, D)}; "
                        f"pick a group_size that divides it")
            if self.rotate and hadamard_block(D) < 2:
                return (f"the {part}' width {D} is odd: a Hadamard rotation needs blocks of a power of two "
                        f"(use rotate=None)")
        unit = max(8 // math.gcd(8, bits) for bits in (self.key_bits, self.value_bits))  # codes a whole byte holds
        D = spec.head_dim
        if D % unit or spec.value_width % unit:
            return (f"head_dim {D} does not pack into whole bytes at {self.key_bits}/{self.value_bits} bits (it must "
                    f"be a multiple of {unit}); pick 4 or 8 bits")
        return None

    def codecs(self, spec: LayerSpec) -> tuple[Codec, Codec]:
        """How ``spec``'s keys and values are encoded (see :mod:`kvexplore.caches.kv_codec`)."""
        made = []
        for bits, axis, D, pre_rope in ((self.key_bits, self.key_axis, spec.head_dim, self.pre_rope_keys),
                                        (self.value_bits, self.value_axis, spec.value_width, False)):
            group = self.group_size if axis == "channel" else min(self.group_size, D)
            if self.rotate and D not in self._rotations:
                self._rotations[D] = hadamard(D, hadamard_block(D)).to(self.device)
            rotation = self._rotations[D] if self.rotate else None
            made.append(Codec(bits, axis, group, rotation, math.ceil(self.outliers * D), pre_rope))
        return made[0], made[1]

    def full_layer(self, spec: LayerSpec) -> QuantizedLayer:
        layer = QuantizedLayer(spec, self.batch_size, self.dtype, self.device, self._capacity, self.codecs(spec),
                               self.group_size, self.residual, self.config.layer_types[spec.index])
        layer.exact_prefill = self.exact_prefill
        return layer

    def _attach(self, model) -> None:
        for layer in self._full():  # pre-RoPE keys turn back and forth with the model's rotary
            layer.rotary = model.rotary

    def _full(self) -> list[QuantizedLayer]:
        return [self.layers[i] for i in self.full_layers]

    @property
    def quantized_upto(self) -> int:
        """The frontier ``Q``: positions ``0..Q-1`` are quantized."""
        return self.layers[self.full_layers[0]].qf if self.full_layers else 0

    @property
    def quantization(self) -> "KiviStorage":
        return KiviStorage(self)

    def truncate(self, n: int) -> None:
        """Keep positions ``0..n-1``; truncated in the middle of a pass, every layer is brought to the same frontier
        (quantizing kept positions, exactly as the retry of the pass would)."""
        super().truncate(n)
        target = max((layer.qf for layer in self._full()), default=0)
        for layer in self._full():
            layer.advance(target, n, self.book.counters)
        self.book.counters = StepCounters()  # what the realignment wrote is no step's


class KiviStorage(LossyStorage):
    """The quantized cache's lossy storage: its layers' records, and the bound of KIVI's codes."""

    def value_group(self, layer: int) -> int:
        """Channels per value scale in ``layer``, on the token axis: ``min(group_size, head_dim)``."""
        return min(self.cache.group_size, self.cache.plan[layer].value_width)

    def quantization_error(self, layer: int, part: str = "kv") -> torch.Tensor:
        """Max abs error ``|x - dequant(quant(x))|`` over head_dim, ``(B, H, length)`` float32, for ``part``
        ``"k"``, ``"v"`` or ``"kv"`` (the larger of both). 0 for positions that never left full precision."""
        if part not in ("k", "v", "kv"):
            raise SettingsError(f"part must be 'k', 'v' or 'kv', got {part!r}")
        return self.cache.layers[layer].error(self.cache.length, part)

    def bytes_breakdown(self) -> dict[str, int]:
        """Bytes of storage held, by part: integer codes, scales + zeros, exact outliers, full-precision residual."""
        out = {"integers": 0, "scales": 0, "residual": 0, **({"outliers": 0} if self.cache.outliers else {})}
        for layer in self.cache._full():
            for name, n in layer.bytes_by_part().items():
                out[name] += n
        return out

    @property
    def diagnostic_bytes(self) -> int:
        """Bytes of the per-position error records (not part of the reserved bytes)."""
        return sum(layer.kerr.nbytes + layer.verr.nbytes for layer in self.cache._full())

    def error_bound(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        """How far each element at positions ``0..Q-1`` may be read back from ``keys``/``values`` ``(H, T, D)``:
        half a quantization step of its group (through a rotation or pre-RoPE keys, the length of the vector of those),
        0 in the residual and for outliers kept exact; None until something is quantized and for layers it does not
        quantize."""
        q = self.cache.quantized_upto
        if not q or layer not in self.cache.full_layers:
            return None
        target = self.cache.layers[layer]
        positions = torch.arange(q, device=self.cache.device)  # where the codec's rotation and the rotary's tables are
        out = []
        for codec, x in ((target.kcodec, keys), (target.vcodec, values)):
            b = torch.zeros(x.shape, dtype=F32)
            b[:, :q] = codec.bound(x[None, :, :q].to(self.cache.device), positions, target.rope_turn)[0].cpu()
            out.append(b)
        return out[0], out[1]


class QuantizedInspector(Inspector):
    """What a quantized cache can say about itself: what it did to the sequence so far."""

    def what_it_did(self) -> str:
        cache = self.cache
        q, n = cache.quantized_upto, cache.length
        if not q:
            return (f"quantized cache: nothing quantized yet: all {n} positions are inside the residual (a block of "
                    f"{cache.group_size} is quantized once {cache.residual} newer positions follow it, from "
                    f"{cache.residual + cache.group_size} positions on; a smaller residual or group_size quantizes "
                    f"sooner)")
        width = (f"{cache.key_bits} bits" if cache.key_bits == cache.value_bits else
                 f"{cache.key_bits}-bit keys and {cache.value_bits}-bit values")
        scheme = cache.layers[cache.full_layers[0]].scheme()
        how = f" ({scheme})" if scheme else ""
        return (f"quantized cache: positions 0..{q - 1} quantized to {width}{how}, the last {n - q} kept in full "
                f"precision")
