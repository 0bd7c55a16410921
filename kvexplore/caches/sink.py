"""StreamingLLM attention sinks: keep the first ``sinks`` positions and the last ``window`` positions, nothing else.

Storage, per layer: ``k``/``v`` of ``[batch, kv_heads, sinks + window, head_dim]``, allocated once. Slot ``p`` holds
position ``p`` for ``p < sinks``; the other ``window`` slots are a ring: position ``p >= sinks`` lives in slot
``sinks + (p - sinks) % window``, so writing position ``p`` overwrites (evicts) position ``p - window``. Memory
stays flat however long the sequence grows; a step writes one token's keys and copies nothing.

Positions: kept keys keep their *original* positions. Keys are cached after RoPE at their true position and are
never re-rotated; a new query is rotated at its true position ``pos``. Attention of a step is therefore exactly
the full model's attention restricted to the kept keys (sinks + last ``window``), which is what the tests check
against a masked recomputation. Why not the paper's positions-within-the-cache (re-rotating every kept key each
step): that rewrites the whole cache every step (copies, no longer "written in place") and its logits match no
masked reference of the original model. The price of original positions: they grow without bound, past
``max_position_embeddings`` the model sees positions it was not trained on (quality may drop, nothing breaks).
Pass ``max_seq_len`` to refuse positions past a limit; by default ``capacity`` is None (unbounded).

``length`` is the number of positions the sequence has reached (the generator feeds ``tokens[length:]`` at
``length``); the slots held are ``min(length, sinks) + (length - window_start)``, at most ``sinks + window``.
Evicted positions are always the contiguous run ``sinks .. window_start - 1`` (:attr:`evicted_positions`);
:attr:`evicted_last_step` lists those the last forward pass evicted.

What attention reads: ``write`` returns the held slots *in storage order* (a view of the storage, no gather, no
copy): the sinks, then the ring as it lies. For a single new token the order does not matter (softmax over a set;
positions live in the rotated keys) and every kept key is at or before the query, so no mask is needed.
:meth:`held_positions` gives the position of each column (for tracers reading ``attn.probs``). Writes of several
tokens (a prompt) must fit without evicting, since the model's causal mask assumes keys ``0..pos+T-1``: a longer
prompt raises "window too small for a prompt" before anything is written.

Rewind (``truncate(n)``): allowed to ``n <= sinks`` (only sinks remain) or ``n >= window_start`` (the evicted
positions stay evicted, so the window holds fewer than ``window`` positions until it refills; meanwhile the
reads are gathered into new tensors, counted as copies). Rewinding into evicted positions raises, changing nothing.
"""

from __future__ import annotations

import torch

from ..config.model_config import ModelConfig
from ..core.settings import integer, positive_int
from ..errors import CacheFullError, SettingsError
from .memory import full_layer_bytes
from .base import EVICTED, FILLED, FREE, STALE, KVCache, SlotView
from .layout import RingLayout


class SinkCache(KVCache):
    """``sinks`` attention-sink positions plus a ring of the last ``window`` positions (see the module docs)."""

    kind = "sink"

    def __init__(self, config: ModelConfig, window: int, sinks: int = 4, batch_size: int = 1,
                 dtype: torch.dtype | None = None, device: str | torch.device | None = None,
                 max_seq_len: int | None = None) -> None:
        window = positive_int(window, "window")
        sinks = integer(sinks, "sinks", minimum=0)
        if max_seq_len is not None:
            max_seq_len = integer(max_seq_len, "max_seq_len", minimum=1, hint=" (or None for unbounded)")
        super().__init__(config, batch_size, dtype or torch.float32, device or "cpu")
        self.sinks, self.window, self._capacity = sinks, window, max_seq_len
        self._k = self._per_full_layer(lambda i: torch.zeros(self._full_shape(i, sinks + window), dtype=self.dtype,
                                                             device=self.device))
        self._v = self._per_full_layer(lambda i: torch.zeros(self._full_shape(i, sinks + window, values=True),
                                                             dtype=self.dtype, device=self.device))
        self._ws = sinks  # window start: first window position held; sinks..ws-1 were evicted
        self._slot_pos = [-1] * (sinks + window)  # position last written to each slot (-1: never)
        self._pending: tuple | None = None  # (pos, end, ws_before, ws_after, read) of the step being written
        self._evicted_last: list[int] = []

    # -- positions and slots -------------------------------------------------------------------------------
    @property
    def window_start(self) -> int:
        """First window position held (positions ``sinks .. window_start - 1`` were evicted)."""
        return self._ws

    @property
    def evicted_positions(self) -> range:
        """Every position of the sequence evicted so far (always contiguous)."""
        return range(self.sinks, self._ws)

    @property
    def evicted_count(self) -> int:
        return self._ws - self.sinks

    @property
    def evicted_last_step(self) -> list[int]:
        """Positions the last forward pass evicted (empty after a rewind)."""
        return list(self._evicted_last)

    @property
    def held(self) -> int:
        """Number of positions held (slots filled): ``min(length, sinks + window)`` on an uninterrupted run."""
        return min(self.length, self.sinks) + max(0, self.length - self._ws)

    def _slot(self, p: int) -> int:
        return p if p < self.sinks else self.sinks + (p - self.sinks) % self.window

    def _held_slots(self, end: int, ws: int) -> list[int]:
        return sorted([*range(min(end, self.sinks)), *(self._slot(p) for p in range(ws, end))])

    def held_positions(self) -> list[int]:
        """Positions held, in the order :meth:`write` returns their keys (storage order)."""
        return [self._slot_pos[s] for s in self._held_slots(self.length, self._ws)]

    def _rewind_error(self, n: int) -> str | None:
        if n <= self.sinks or n >= self._ws:
            return None
        return (f"cannot rewind to {n}: positions {self.sinks}..{self._ws - 1} were evicted (the window starts at "
                f"position {self._ws}); rewind to {self._ws} or later, or to {self.sinks} or earlier (sinks only)")

    # -- the write protocol --------------------------------------------------------------------------------
    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        super().check_write(pos, q_len, batch_size)
        if pos < self.length and (msg := self._rewind_error(pos)):
            raise SettingsError(f"write at position {pos} needs a rewind: {msg}")
        end = pos + q_len
        if self._capacity is not None and end > self._capacity:
            raise CacheFullError(used=pos, needed=q_len, capacity=self._capacity)
        ws_before = self.sinks if pos <= self.sinks else self._ws
        evicts = max(ws_before, end - self.window) > self.sinks  # keys read would not be positions 0..end-1
        if evicts and q_len > 1:
            held = f"has evicted positions {self.sinks}..{ws_before - 1}" if ws_before > self.sinks else (
                f"holds {self.sinks + self.window} positions")
            raise SettingsError(
                f"window too small for a prompt of {q_len} tokens at position {pos}: SinkCache(sinks={self.sinks}, "
                f"window={self.window}) {held}, and a write of several tokens must fit without evicting (the "
                f"model's causal mask assumes keys 0..{end - 1}); use window >= {end - self.sinks} or feed the "
                f"tokens one at a time")

    def begin_step(self, pos: int = 0, q_len: int = 0) -> None:
        super().begin_step(pos, q_len)
        self._pending = None

    def _plan(self, pos: int, end: int) -> tuple:
        """Once per step (first layer): slot bookkeeping and what attention reads."""
        ws_before = self.sinks if pos <= self.sinks else self._ws
        ws_after = max(ws_before, end - self.window)
        for p in range(pos, end):
            self._slot_pos[self._slot(p)] = p
        if ws_after == self.sinks:
            read = end  # nothing evicted: slots 0..end-1 hold positions 0..end-1
        elif end - ws_after == self.window:
            read = self.sinks + self.window  # every slot held: the whole storage
        else:  # window not full after a rewind into it: only some ring slots are held
            read = torch.tensor(self._held_slots(end, ws_after), device=self.device)
        return pos, end, ws_before, ws_after, read

    def _write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_len = k.shape[2]
        if self._pending is None:
            self._pending = self._plan(pos, pos + q_len)
        read = self._pending[4]
        slot = self._slot(pos)  # a write of several tokens never wraps (check_write), so its slots are contiguous
        self._keep(self._k[layer], 2, slot, q_len)  # what the slots held (an evicted position): for a rollback
        self._keep(self._v[layer], 2, slot, q_len)
        self._k[layer].narrow(2, slot, q_len).copy_(k)  # in place: no allocation
        self._v[layer].narrow(2, slot, q_len).copy_(v)
        step = self._step
        step.written_bytes += k.nbytes + v.nbytes
        if isinstance(read, int):
            return self._k[layer].narrow(2, 0, read), self._v[layer].narrow(2, 0, read)  # views
        k_all, v_all = self._k[layer].index_select(2, read), self._v[layer].index_select(2, read)
        step.copied_bytes += k_all.nbytes + v_all.nbytes  # temporaries, dropped after the layer's attention
        step.allocated_bytes += k_all.nbytes + v_all.nbytes
        step.freed_bytes += k_all.nbytes + v_all.nbytes
        step.allocations += 2
        step.frees += 2
        return k_all, v_all

    def commit(self, end: int) -> None:
        if self._pending is not None:
            _, _, ws_before, ws_after, _ = self._pending
            self._evicted_last = list(range(ws_before, ws_after))
            self._ws = ws_after
        else:
            self._evicted_last = []
        self._pending = None
        super().commit(end)

    def _snapshot(self) -> dict:
        return {**super()._snapshot(), "_slot_pos": list(self._slot_pos), "_ws": self._ws,
                "_evicted_last": list(self._evicted_last), "_pending": None}

    def _restore(self, snapshot: dict) -> None:
        super()._restore({**snapshot, "_slot_pos": list(snapshot["_slot_pos"])})

    def check_truncate(self, n: int, rings: bool = True) -> None:
        super().check_truncate(n, rings)
        if msg := self._rewind_error(n):
            raise SettingsError(msg)

    def truncate(self, n: int) -> None:
        if self._pending is not None:  # truncated mid-step (a failed step rolls back instead): overwritten = lost
            self._ws = max(self._ws, self._pending[3])
            self._pending = None
        super().truncate(n)
        if n <= self.sinks:
            self._ws = self.sinks
        self._evicted_last = []

    # -- inspection ----------------------------------------------------------------------------------------
    def _slot_view(self) -> SlotView:
        states, positions, sharers = [], [], []
        for p in self._slot_pos:
            held = 0 <= p < self.length and (p < self.sinks or p >= self._ws)
            state = FILLED if held else FREE if p < 0 else EVICTED if self.sinks <= p < self._ws else STALE
            states.append(state)
            positions.append(p if held else -1)
            sharers.append(1 if held else 0)
        layout = RingLayout(sinks=self.sinks, window=self.window, ring_start=self._slot(self._ws),
                            write_slot=self._slot(self.length), evicted=self.evicted_count)
        return SlotView(states, positions, sharers, layout)

    def _storage(self, layer: int) -> list[torch.Tensor]:
        return [self._k[layer], self._v[layer]]

    def _read_positions(self) -> list[int]:
        return self.held_positions()  # write() returns the held slots in storage order

    def key(self, layer: int) -> torch.Tensor:
        """The live key storage of ``layer``: ``sinks + window`` slots in storage order."""
        return self._k[layer]

    def value(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def _clone_storage(self, twin: "SinkCache") -> None:
        twin._k = [None if t is None else t.clone() for t in self._k]
        twin._v = [None if t is None else t.clone() for t in self._v]
        twin._slot_pos, twin._evicted_last, twin._pending = list(self._slot_pos), list(self._evicted_last), None

    @property
    def full_reserved_bytes(self) -> int:
        return full_layer_bytes(self.config, self.sinks + self.window, self.batch_size, self.dtype)
