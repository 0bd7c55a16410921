"""Plain decoding: positions and slots. A cached decode step must turn its key at its own position and store it in its
own slot; when either is off, the prompt (computed in one pass) is right and every token after it reads a sequence
that is not the one it was given."""

from __future__ import annotations

from typing import Any

import torch

from ..caches.factory import make_cache
from ..caches.layers.preallocated_layer import PreallocatedLayer
from ..caches.strategies.preallocated import PreallocatedCache
from ..models.rope import Rotary
from .catalog import Bug, register
from .models import with_module
from .runs import decode_scenario, planted_maker

TEXT = "Once upon a time, a little cache kept every key it was given, and"
STEPS = 24


class PositionZeroRotary(Rotary):
    """The planted bug: a pass of one token (a cached decode step) is turned as if at position 0, the cache's offset
    left out of its position ids; a pass of several (the prompt) is turned right."""

    def cos_sin(self, pos: int, length: int, dtype: torch.dtype, layer_type: str = "full_attention"):
        return super().cos_sin(0 if length == 1 else pos, length, dtype, layer_type)


def _rope_zero(model: Any, planted: bool, slots: int = 64) -> tuple[Any, Any]:
    if planted:
        model = with_module(model, "rotary", PositionZeroRotary(model.config).to(model.device))
    return model, make_cache("preallocated", model, max_seq_len=slots)


_zero_run, _zero_check = decode_scenario(TEXT, STEPS, _rope_zero)
register(Bug(
    name="rope-position-zero", engine="mlx-vlm (Qwen3-Omni)", reference="Blaizzy/mlx-vlm#1983",
    url="https://github.com/Blaizzy/mlx-vlm/issues/1983", area="plain decoding",
    summary="The decode path built its position ids from the new tokens alone (arange(seq_len), no cache offset), so "
            "every generated token was rotated as if at position 0; the prompt, computed in one pass, was right. "
            "Planted as a rotary embedding that turns a one-token pass at position 0.",
    invariant="a cached pass's queries and keys are rotated at cache.length + i, the positions a full recomputation "
              "gives them",
    symptom="the first token after the prompt is right, the rest drift into repetition or nonsense",
    checker="doctor", run=_zero_run, check=_zero_check, make=_rope_zero))


class UpperLayersLate(PreallocatedLayer):
    """The planted bug: in a decode step, every layer above the first stores the new key and value one slot past its
    position (as if the shared length had already moved when layer 0 wrote), and attention reads up to the position:
    the slot it should read holds nothing, the token's own key is never read."""

    def write(self, step, k, v):
        if self.spec.index == 0 or k.shape[2] != 1 or step.pos + 1 >= self.capacity:
            return super().write(step, k, v)
        pos = step.pos
        self.prepare(step, pos, 2)
        self.k.narrow(2, pos + 1, 1).copy_(k)
        self.v.narrow(2, pos + 1, 1).copy_(v)
        return self.k.narrow(2, 0, pos + 1), self.v.narrow(2, 0, pos + 1)


class LateCache(PreallocatedCache):
    def full_layer(self, spec):
        return UpperLayersLate(spec, self.batch_size, self.dtype, self.device, self.capacity)


_late = planted_maker(LateCache, "preallocated")
_late_run, _late_check = decode_scenario(TEXT, STEPS, _late)
register(Bug(
    name="length-counted-early", engine="flash-linear-attention", reference="fla-org/flash-linear-attention#766",
    url="https://github.com/fla-org/flash-linear-attention/issues/766", area="plain decoding",
    summary="The cache's seen-token count was incremented when layer 0 wrote, before the other layers of the same "
            "pass ran, so every layer above the first worked one position further than the token it was given. "
            "Planted as layers above 0 storing a decode step's key and value one slot late.",
    invariant="every layer of one pass writes the same positions, pos .. pos + q_len - 1, and reads up to the same "
              "end; the length moves once, after the last layer",
    symptom="layer 0 is exact and the upper layers are not; output degrades from the first decoded token",
    checker="doctor", run=_late_run, check=_late_check, make=_late))
