"""Quantization: a quantized cache may lose only what its scheme allows, every element read back within half a
quantization step of its own group; the doctor checks the keys read against that bound."""

from __future__ import annotations


import torch

from ..caches.kivi import pack
from ..caches.kv_codec import Codec
from ..caches.layers.quantized_layer import QuantizedLayer
from ..caches.strategies.quantized import QuantizedCache
from .catalog import Bug, register
from .runs import decode_scenario, planted_maker

TEXT = ("Once upon a time, a little cache kept every key it was given, and it wrote each of them down in four bits "
        "so that many more of them would fit")
STEPS = 16
#: the scheme both runs use: 4-bit KIVI, blocks of 8, the last 8 positions in full precision (the prompt leaves
#: several blocks quantized at once, so the first lossy step already holds more than one block)
OPTIONS = {"bits": 4, "group_size": 8, "residual": 8}


def codes_with(codec: Codec, y: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Packed codes of float32 ``y`` ``(B, H, T, D)`` (in the domain the codec takes codes in) quantized with the given
    ``scale`` and ``zero`` (the shapes of :meth:`Codec.encode`'s), clipped to the code range as a kernel would."""
    B, H, T, D = y.shape
    if codec.axis == "channel":
        g, s, z = y.reshape(B, H, T // codec.group, codec.group, D), scale.unsqueeze(3), zero.unsqueeze(3)
    else:
        g, s, z = y.reshape(B, H, T, D // codec.group, codec.group), scale.unsqueeze(4), zero.unsqueeze(4)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = ((g - z) / safe).round_().clamp_(0, 2 ** codec.bits - 1).to(torch.uint8)
    return pack(q.reshape(B, H, T, D), codec.bits)


class FirstScaleLayer(QuantizedLayer):
    """The planted bug: the first group a layer quantizes fixes its scale and zero for good (its first input's
    range); every later group is coded with them, and what falls outside that range is clipped."""

    frozen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # part -> the first group's (scale, zero); replaced

    def encode(self, codec: Codec, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        stored = super().encode(codec, x, positions)
        part = "k" if codec is self.kcodec else "v"
        if part not in self.frozen:
            first = (stored["scale"].narrow(2, 0, 1).clone(), stored["zero"].narrow(2, 0, 1).clone())
            self.frozen = {**self.frozen, part: first}
        scale, zero = (t.expand_as(stored["scale"]).contiguous() for t in self.frozen[part])
        y, _, _ = codec.split(codec.transform(x, positions, self.rope_turn))
        stored.update(codes=codes_with(codec, y, scale, zero), scale=scale, zero=zero)
        return stored


class UnitScaleLayer(QuantizedLayer):
    """The planted bug: the write takes its codes as if the scale were 1.0 (the group's scale never reaches it),
    while the stored scale, the one the read multiplies the codes by, is the group's own."""

    def encode(self, codec: Codec, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        stored = super().encode(codec, x, positions)
        y, _, _ = codec.split(codec.transform(x, positions, self.rope_turn))
        stored["codes"] = codes_with(codec, y, torch.ones_like(stored["scale"]), stored["zero"])
        return stored


class PlantedQuantizedCache(QuantizedCache):
    """kvexplore's quantized cache with every full layer of class ``layer_class`` (set by a subclass)."""

    layer_class: type = QuantizedLayer

    def full_layer(self, spec):
        layer = self.layer_class(spec, self.batch_size, self.dtype, self.device, self._capacity, self.codecs(spec),
                                 self.group_size, self.residual, self.config.layer_types[spec.index])
        layer.exact_prefill = self.exact_prefill
        return layer


class FirstScaleCache(PlantedQuantizedCache):
    layer_class = FirstScaleLayer


class UnitScaleCache(PlantedQuantizedCache):
    layer_class = UnitScaleLayer


_make_first = planted_maker(FirstScaleCache, "quantized", OPTIONS)
_first_run, _first_check = decode_scenario(TEXT, STEPS, _make_first)
register(Bug(
    name="scale-from-first-input", engine="vLLM (FP8 KV cache, --calculate-kv-scales)",
    reference="vllm-project/vllm#11906", url="https://github.com/vllm-project/vllm/pull/11906",
    area="quantization",
    summary="vLLM's dynamic KV-cache scales (this pull request) are computed once, from the first real input to each "
            "attention layer, and kept for every later token; keys and values that range wider than that first "
            "input no longer fit the scale and saturate (the risk its review raised: one input standing for every "
            "later one). Planted in KIVI's cache as a layer whose first quantized group fixes the scale and zero of "
            "every later group (values outside that range clip), not as FP8's one scale per tensor.",
    invariant="every quantized element is read back within half a quantization step of its own group: the scale "
              "and zero are those of the values they code",
    symptom="the first block reads back as well as ever; later blocks with a wider range read back clipped, and "
            "the output parts from the fixed cache at the prompt",
    checker="doctor", run=_first_run, check=_first_check, make=_make_first))


_make_unit = planted_maker(UnitScaleCache, "quantized", OPTIONS)
_unit_run, _unit_check = decode_scenario(TEXT, STEPS, _make_unit)
register(Bug(
    name="scale-left-at-one", engine="SGLang (FP8 KV cache, --quantization-param-path)",
    reference="sgl-project/sglang#18818", url="https://github.com/sgl-project/sglang/issues/18818",
    area="quantization",
    summary="KV-cache scales loaded from a JSON file were never passed to the cache write (k_scale and v_scale "
            "were None in set_kv_buffer), so keys and values were written as if the scale were 1.0 whatever the "
            "loaded scales said; some backends fell back to 1.0 silently (sglang#20705). Planted in KIVI's cache "
            "as a layer whose write takes its codes with a scale of 1.0 while the scale it stores, which the read "
            "multiplies the codes by, is the group's own: the write and the read disagree about the scale.",
    invariant="the scale a code is written with is the scale it is read back with; every element reads back "
              "within half a step of its group",
    symptom="nothing is wrong while every position is in the full-precision window; from the first quantized "
            "block on, keys and values read back far from what was written and the output parts at once",
    checker="doctor", run=_unit_run, check=_unit_check, make=_make_unit))
