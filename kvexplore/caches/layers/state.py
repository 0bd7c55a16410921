"""A linear-attention layer's cache: a fixed-size recurrent state instead of keys and values. A gated DeltaNet layer
(Qwen3-Next) keeps the last ``conv_kernel - 1`` inputs of its causal convolution (``conv``, ``(B, channels, kernel -
1)``, the cache's dtype) and its recurrent state (``recurrent``, ``(B, value heads, key dim, value dim)``, float32 as
transformers keeps it), both replaced in place each step. An earlier state cannot be recovered from a later one, so
``truncate(n)`` for ``0 < n < length`` is refused and the generator recomputes (``cache.inspect.needs_replay``). With
``cache.states.checkpointing`` (a verification pass) the layer keeps the state after each position written (``k + 1``
copies, counted as allocated) until the next step, so a cut back to any of them restores it exactly."""

from __future__ import annotations

from typing import Any

import torch

from ...errors import SettingsError
from ..layer import LayerCache, Step, shallow_copy
from ..layout import StateLayout
from ..memory import StepCounters
from ..slots import SlotView


class StateLayer(LayerCache):
    _held_names = {"": "recurrent state", "checkpoints": "state checkpoints"}

    def __init__(self, spec, config, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(spec)
        c = config
        self._batch, self._dtype = batch_size, dtype
        self.analytic = config.state_bytes(batch_size, dtype.itemsize)
        self.conv = torch.zeros(batch_size, c.conv_channels, c.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(batch_size, c.linear_value_heads, c.linear_key_dim, c.linear_value_dim,
                                     dtype=torch.float32, device=device)

    checkpoints: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (first position, convs, recurrents) of a step

    def begin(self, step: Step) -> None:
        step.journal.remember(self._forget, self.checkpoints)
        self.checkpoints = None
        if step.pos == 0:  # a new sequence starts from zero state
            for t in (self.conv, self.recurrent):
                step.journal.keep(t, 0, 0, t.shape[0])
                t.zero_()

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise SettingsError(f"layer {self.spec.index} is a linear-attention layer: it keeps a state, not keys and "
                            f"values; use read_state/write_state")

    def read_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.conv, self.recurrent

    def _forget(self, saved) -> None:
        self.checkpoints = saved

    def write_state(self, step: Step, conv: torch.Tensor, recurrent: torch.Tensor, checkpoints=None) -> None:
        """Replace the state in place (the old one kept in the journal for a rollback), and keep ``checkpoints``."""
        for old, new in ((self.conv, conv), (self.recurrent, recurrent)):
            step.journal.keep(old, 0, 0, old.shape[0])
            old.copy_(new)
            step.counters.written_bytes += old.nbytes
        if checkpoints is not None:
            convs, states = checkpoints
            self.checkpoints = (step.pos, convs.to(self.conv.dtype), states.to(self.recurrent.dtype))
            step.counters.allocated_bytes += convs.nbytes + states.nbytes
            step.counters.allocations += 2

    _crop_way = ("the state after the draft has taken in every drafted token: the state after the last accepted one "
                "is restored from the checkpoint the verification kept per position (or, without checkpoints, the "
                "step is rolled back and the accepted tokens recomputed)")

    def _checkpoint(self, n: int) -> int | None:
        """Index of the checkpoint holding the state after position ``n - 1`` (None: none does)."""
        if self.checkpoints is None:
            return None
        first, convs, _ = self.checkpoints
        return n - 1 - first if 0 <= n - 1 - first < convs.shape[0] else None

    def _crop_error(self, n: int, length: int) -> str | None:
        if 0 < n < length and self._checkpoint(n) is None:
            return f"a linear-attention state has taken in positions {n}..{length - 1} and cannot give them back"
        return None

    def _replay_error(self, n: int, length: int) -> str | None:
        if 0 < n < length and self._checkpoint(n) is None:
            return (f"the linear-attention layers keep one state, of position {length - 1}, and cannot go back "
                    f"to {n}; rewind with the generator (it recomputes), or start again from position 0")
        return None

    def truncate(self, n: int, length: int, counters: StepCounters) -> None:
        if 0 < n < length and (i := self._checkpoint(n)) is not None:
            _, convs, states = self.checkpoints
            self.conv.copy_(convs[i])
            self.recurrent.copy_(states[i])
            counters.copied_bytes += self.conv.nbytes + self.recurrent.nbytes
        self.checkpoints = None
        if n == 0:
            self.conv.zero_()
            self.recurrent.zero_()

    def _held_positions(self, length: int) -> list[int]:
        return []  # a state summarises every position and holds none

    def _read_positions(self, length: int) -> list[int]:
        return []  # no attention: the state summarises every position

    def storage(self) -> list[torch.Tensor]:
        return [self.conv, self.recurrent]

    def _reserved_bytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def _used_bytes(self, length: int) -> int:
        return self._reserved_bytes()  # a fixed block, the same after every step

    def _analytic_bytes(self, length: int) -> int:
        return self.analytic

    def _slot_view(self, length: int) -> SlotView:
        return SlotView([], [], [], StateLayout(conv_bytes=self.conv.nbytes, recurrent_bytes=self.recurrent.nbytes,
                                                shape=list(self.recurrent.shape[1:])))

    def clone(self, memo: dict[int, Any], fork: bool = False) -> "StateLayer":
        twin = shallow_copy(self, StateLayer)
        twin.conv, twin.recurrent = self.conv.clone(), self.recurrent.clone()
        return twin

    def describe(self, count: int, strategy: str, config) -> str:
        return f"{count} linear-attention layer{'s' * (count != 1)}: a fixed state of {self._reserved_bytes()} B each"
