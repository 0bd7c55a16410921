"""What a pressing cache did, recorded with each step (:func:`record`): the last press's scores and choice per KV head,
the positions each head holds and the bytes a full cache would hold. A press's outcome is recorded once and shared
by the records of every step until the next press (a press replaces its host tensors, never writes into them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..caches.memory import kv_bytes


@dataclass(frozen=True)
class PressOutcome:
    """One press: at sequence ``length``, for ``reason`` (``"prompt"``, ``"decode"``); per pressed layer, its
    scores ``(kv_heads, length)`` by position (NaN where nothing was held then) and what it kept (bool, same shape)."""

    length: int
    reason: str
    scores: dict[int, torch.Tensor]
    kept: dict[int, torch.Tensor]
    press: str = ""  # the press's name (knorm, snapkv, ...)


@dataclass(frozen=True)
class PressStep:
    """A pressing cache after one step."""

    length: int  # positions in the sequence
    held: dict[int, tuple[int, ...]]  # pressed layer -> positions each KV head holds
    presses: int  # presses so far
    last: PressOutcome | None  # the last press so far (None before any)
    full_bytes: int  # what a full cache of ``length`` positions holds (kvexplore.caches.memory.kv_bytes)

    @property
    def layers(self) -> list[int]:
        return sorted(self.held)

    def kept_mask(self, layer: int) -> np.ndarray:
        """``(kv_heads, length)`` bool: the positions each head of ``layer`` holds after the step: what the last
        press kept of the positions before it, and every position written since."""
        heads = len(self.held[layer])
        out = np.ones((heads, self.length), dtype=bool)
        if self.last is not None and layer in self.last.kept:
            kept = self.last.kept[layer].numpy()
            n = min(kept.shape[1], self.length)
            out[:, :n] = kept[:, :n]
        return out


def record(cache: Any, previous: PressOutcome | None = None) -> PressStep | None:
    """``cache``'s press state after a step (None for a cache that does not press). ``previous``: the outcome
    recorded last, reused while no new press ran."""
    eviction = cache.eviction
    if eviction is None:
        return None
    layers = list(cache.full_layers)
    got = {layer: s for layer in layers if (s := eviction.press_scores(layer)) is not None}
    last = None
    if got:
        if previous is not None and all(layer in previous.scores and previous.scores[layer] is s[0]
                                        for layer, s in got.items()):
            last = previous
        else:
            events = eviction.press_events
            reason = events[-1].reason if events else ""
            length = next(iter(got.values()))[0].shape[1]
            last = PressOutcome(length, reason, {layer: s[0] for layer, s in got.items()},
                                {layer: s[1] for layer, s in got.items()}, eviction.press.name)
    held = {layer: eviction.held_counts(layer) for layer in layers}
    return PressStep(cache.length, held, len(eviction.press_events), last,
                     kv_bytes(cache.config, cache.length, cache.batch_size, cache.dtype))


def press_row(step: PressStep, tensors: dict[str, torch.Tensor], outcomes: dict[int, int]) -> dict:
    """``step`` as a trace file's JSON row; its press outcome's tensors go into ``tensors`` once (``outcomes``: the
    outcomes saved so far, by identity, to their number)."""
    last = None
    if step.last is not None:
        last = outcomes.get(id(step.last))
        if last is None:
            last = outcomes[id(step.last)] = len(outcomes)
            for layer in step.last.scores:
                tensors[f"press.{last}.scores.{layer}"] = step.last.scores[layer].contiguous()
                tensors[f"press.{last}.kept.{layer}"] = step.last.kept[layer].to(torch.uint8).contiguous()
        last = {"index": last, "length": step.last.length, "reason": step.last.reason,
                "layers": sorted(step.last.scores), "press": step.last.press}
    return {"length": step.length, "held": {str(k): list(v) for k, v in step.held.items()}, "presses": step.presses,
            "full_bytes": step.full_bytes, "last": last}


def press_from_row(row: dict, f: Any, outcomes: dict[int, PressOutcome]) -> PressStep:
    """The :class:`PressStep` of a trace file's row (``f``: the open file; ``outcomes``: those read so far, so that
    records share one outcome again)."""
    last = row.get("last")
    outcome = None
    if last is not None:
        outcome = outcomes.get(last["index"])
        if outcome is None:
            i = last["index"]
            outcome = outcomes[i] = PressOutcome(
                last["length"], last["reason"],
                {layer: f.get_tensor(f"press.{i}.scores.{layer}") for layer in last["layers"]},
                {layer: f.get_tensor(f"press.{i}.kept.{layer}").bool() for layer in last["layers"]},
                last.get("press", ""))
    return PressStep(row["length"], {int(k): tuple(v) for k, v in row["held"].items()}, row["presses"], outcome,
                     row["full_bytes"])
