"""What every pressed layer of one ``evict`` cache shares: the press, the budget, the rules of when it runs, the
model's rotary embedding (for re-rotation) and the history of the presses so far. When a press runs (after the
prompt; with ``decode_every`` while decoding: docs/eviction.md) is decided once per step, by the first layer that
commits it (:meth:`PressPlan.decide`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..layer import Step, shallow_copy
from ..presses import Budget, Press


@dataclass(frozen=True)
class PressEvent:
    """One press: after the step that reached ``length`` positions, for ``reason`` (``"prompt"`` or ``"decode"``),
    to ``kept`` positions per head in each pressed layer (in order)."""

    length: int
    reason: str
    kept: tuple[int, ...]


class PressPlan:
    def __init__(self, press: Press, budget: Budget, rerotate: bool, decode_every: int | None,
                 decode_target: int | None, layers: list[int]) -> None:
        self.press, self.budget, self.rerotate = press, budget, rerotate
        self.decode_every, self.decode_target = decode_every, decode_target
        self.layers = layers  # the pressed layers, in order (a schedule's index)
        self.queries = max(press.queries, 1 if press.accumulates else 0)  # whether layers hand their queries over
        # recent queries each layer keeps: the press's window, and the tokens a rewind may drop before the next press
        self.kept_queries = self.queries + ((decode_every or 0) if press.queries else 0)
        self.rotary: Any = None  # the model's Rotary, attached by the model before a step (re-rotation needs it)
        self.sinks: dict[int, Any] = {}  # layer -> the model's attention with learned sink logits (gpt-oss)
        self.anchor = 0  # the length at the last press (or the prompt): decoding presses count tokens from there
        self.horizon = 0  # the length at the last press: positions before it may be evicted
        self.target: int | None = decode_target
        self.events: list[PressEvent] = []
        self._step: int | None = None  # the serial of the step planned (not the step: its journal is not ours to keep)
        self._decision: tuple[str, list[int]] | None = None

    def slot(self, layer: int) -> int:
        return self.layers.index(layer)

    def begin(self, step: Step) -> None:
        if self._planned(step):
            return
        step.journal.remember(self._restore, (self.anchor, self.horizon, self.target, list(self.events)))
        self._step, self._decision = step.serial, None
        if step.pos == 0:
            self.restart()

    def sink_logits(self, layer: int) -> torch.Tensor | None:
        """The model's learned sink logits of ``layer`` (gpt-oss), for the attention a press reads; None: none."""
        attention = self.sinks.get(layer)
        return None if attention is None else attention.sinks.detach()

    def _planned(self, step: Step) -> bool:
        return self._step == step.serial

    def restart(self) -> None:
        """A new sequence (a truncate to 0, or a write at position 0): no press so far."""
        self.anchor = self.horizon = 0
        self.target, self.events = self.decode_target, []

    def replayable(self, n: int) -> bool:
        """Whether one prefill of the first ``n`` tokens makes the cache the presses made (none ran, none would
        run while decoding, and that prefill would not press)."""
        return not self.events and self.decode_every is None and min(self.budget.per_layer(n, len(self.layers))) >= n

    def _restore(self, saved: tuple) -> None:
        self.anchor, self.horizon, self.target, events = saved
        self.events, self._step, self._decision = list(events), None, None

    def decide(self, step: Step) -> tuple[str, list[int]] | None:
        """Whether a press runs after ``step`` (worked out once per step) and, if so, why and the positions per head
        each pressed layer keeps (a layer that holds no more keeps what it holds)."""
        if self._planned(step) and self._decision is not None:
            return self._decision or None
        self.begin(step)
        decision: Any = ()
        n = step.end
        if step.pos == 0 and step.q_len > 1:
            kept = self.budget.per_layer(n, len(self.layers))
            if self.target is None and self.decode_every is not None:
                self.target = self.budget.mean_kept(n)
            if min(kept) < n:  # some layer keeps fewer than the prompt (a pyramid may give the first all of it)
                decision = ("prompt", kept)
            self.anchor = n
        elif self.decode_every is not None:
            # the tokens since the last press, by length (a rewind after it takes back the tokens it dropped)
            if n - self.anchor >= self.decode_every and self.target is not None:
                kept = self.budget.per_layer(n, len(self.layers), self.target)
                decision = ("decode", kept)
                self.anchor = n
        if decision:
            self.horizon = n
            self.events.append(PressEvent(n, decision[0], tuple(decision[1])))
        self._decision = decision
        return decision or None

    def copy(self) -> "PressPlan":
        twin = shallow_copy(self, PressPlan)
        twin.events, twin._step, twin._decision = list(self.events), None, None
        return twin
