"""Eviction: a pressed cache drops positions by design, but what each KV head still holds it must hold exactly (its own
keys and values, read by its own query heads, each turned as the position mode says); the doctor checks it against a
recomputation with the same kept set."""

from __future__ import annotations


import torch

from ..caches.strategies.evict import EvictCache
from ..caches.layers.compact import CompactLayer
from ..caches.layer import Step
from .catalog import Bug, register
from .runs import decode_scenario, planted_maker

TEXT = "Once upon a time, a little cache kept every key it was given, until one day it had to choose which to forget"
STEPS = 16


class HeadZeroReads(CompactLayer):
    """The planted bug: attention reads every KV head's slots as far as KV head 0 holds them (the read mask built
    from head 0's count for every head), so a head that holds fewer reads slots past its own (empty) and a head that
    holds more loses its last ones, the new token's key among them."""

    def _make_mask(self, counts: list[list[int]], T: int, S: int, step: Step) -> torch.Tensor | None:
        first = torch.tensor([[row[0]] * len(row) for row in counts], device=self.device)  # head 0's, every head
        j, t = torch.arange(S, device=self.device), torch.arange(T, device=self.device)
        return j.view(1, 1, 1, S) < first.view(*first.shape, 1, 1) + t.view(1, 1, T, 1) + 1


class RotationFromSlot(CompactLayer):
    """The planted bug: when a press re-rotates the kept keys (``positions="rerotate"``), each key is turned from the
    rotation its slot index says (as if slot and position were one) instead of the rotation the layer recorded: right
    at the first press (the prompt's slots follow its positions), wrong at every press after."""

    def keep(self, step: Step, keep: torch.Tensor, rot: torch.Tensor) -> None:
        slots = torch.arange(self.rot.shape[-1], device=self.rot.device)
        self.rot = slots.expand_as(self.rot).clone()  # the slot index taken for the rotation each key carries
        super().keep(step, keep, rot)


class PlantedEvictCache(EvictCache):
    """kvexplore's evict cache (compacting storage) with every full layer of class ``layer_class``."""

    layer_class: type = CompactLayer

    def full_layer(self, spec):
        return self.layer_class(spec, self.batch_size, self.dtype, self.device, self.pressplan, self.config,
                                self.headroom)


class HeadZeroCache(PlantedEvictCache):
    layer_class = HeadZeroReads


class SlotRotationCache(PlantedEvictCache):
    layer_class = RotationFromSlot


#: an adaptive budget (AdaKV) leaves the layer's KV heads holding different counts of positions
ADAPTIVE = {"press": "knorm", "compression_ratio": 0.5, "heads": "adaptive"}
_make_head = planted_maker(HeadZeroCache, "evict", ADAPTIVE)
_head_run, _head_check = decode_scenario(TEXT, STEPS, _make_head)
register(Bug(
    name="heads-read-head-zero", engine="kvexplore (this project: the explorer's attention of pressed layers)",
    reference="commit c1f6fa9", url="", area="eviction",
    summary="After an adaptive press the KV heads of a layer hold different positions, but the attention of every "
            "query head was mapped with KV head 0's kept positions (and a head holding every position took the "
            "wrong path); the fix reads each KV head's own positions (read_positions_by_head). That was the "
            "explorer's view of the attention; planted here one level down, in the cache itself, as a compacting "
            "layer whose attention reads every KV head's slots as far as head 0 holds them.",
    invariant="each query head attends to exactly the positions its own KV head holds, and to nothing else",
    symptom="exact until the first press; from the first step after it, heads that hold other counts than head 0 "
            "read empty slots or lose their newest keys, and the output drifts",
    checker="doctor", run=_head_run, check=_head_check, make=_make_head))


#: re-rotated keys and presses while decoding: the second press turns keys the first already turned
REROTATE = {"press": "knorm", "compression_ratio": 0.5, "positions": "rerotate", "decode_every": 4}
_make_slot = planted_maker(SlotRotationCache, "evict", REROTATE)
_slot_run, _slot_check = decode_scenario(TEXT, STEPS, _make_slot)
register(Bug(
    name="rotation-from-slot", engine="VeloxQuant-MLX (H2O cache)", reference="rajveer43/VeloxQuant-MLX#137",
    url="https://github.com/rajveer43/VeloxQuant-MLX/issues/137", area="eviction",
    summary="Keys are stored already rotated at their absolute position; after an interior eviction the survivors' "
            "storage index no longer matched the rotation baked into them, scrambling the relative positions every "
            "later query saw (fixed by de-rotating and re-rotating the kept keys to a gap-free layout). Planted "
            "as a compacting layer (positions='rerotate', presses while decoding) that turns each kept key from "
            "its slot index instead of the rotation it recorded: the first press is right (the prompt's slots "
            "follow its positions), every later press turns keys from the wrong origin.",
    invariant="a key is turned by exactly (new rotation - the rotation it holds); the rotation a layer records for "
              "each slot is the one its key carries",
    symptom="exact through the prompt's press; wrong from the step after the first press while decoding",
    checker="doctor", run=_slot_run, check=_slot_check, make=_make_slot))
