"""The interface every KV cache strategy implements, and the checks they share.

Layout, stated once: keys and values are ``[batch, kv_heads, seq, head_dim]`` and keys are stored *after* RoPE.

Who owns what: the caller (the :class:`~kvexplore.Generator`) decides the position of every write; the cache
only records how many leading positions hold valid data (``length``). A forward pass calls
``check_write(pos, q_len)`` before touching anything, ``write(layer, pos, k, v)`` once per layer, then
``commit(pos + q_len)``. A check that fails raises before any layer writes, so a failed step leaves the cache
exactly as it was.

A step can also fail after some layers wrote (an exception in a hook, an interrupt) or after ``commit`` (the
generator then finds the logits unusable): :meth:`rollback` puts back everything the last step changed, so the
cache is exactly as it was before ``begin_step`` (its length, slot map, memory report and the keys and values it
held). ``begin_step`` saves the bookkeeping (:meth:`_snapshot`); a strategy that overwrites held slots in place
saves those slots first (:meth:`_keep`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch

from ..config import ModelConfig
from ..errors import SettingsError
from ..settings import positive_int
from ..memory import MemoryReport, StepCounters, cuda_stats, kv_bytes

FREE, FILLED, STALE, EVICTED, SHARED = "free", "filled", "stale", "evicted", "shared"


@dataclass(frozen=True)
class SlotView:
    """The physical slots of a cache (the same for every layer), in storage order.

    ``states[i]``: ``free`` (never written), ``filled`` (holds ``positions[i]``), ``stale`` (left behind by a
    rewind: written once, no longer part of the sequence), ``evicted`` (its position was dropped by the strategy),
    ``shared`` (filled and shared by ``sharers[i]`` > 1 sequences). ``positions[i]`` is -1 where no position is
    held. ``layout`` carries what a strategy adds (a page table, a ring start).
    """

    states: list[str]
    positions: list[int]
    sharers: list[int]
    layout: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not len(self.states) == len(self.positions) == len(self.sharers):
            raise AssertionError("slot view lists differ in length")

    def count(self, state: str) -> int:
        return self.states.count(state)


class KVCache(ABC):
    """Base class of the cache strategies. Subclasses implement storage; this class keeps the length."""

    #: short name used by the CLI and in records
    kind: str = "base"

    def __init__(self, config: ModelConfig, batch_size: int, dtype: torch.dtype, device: torch.device) -> None:
        positive_int(batch_size, "batch_size")
        self.config = config
        self.batch_size = batch_size
        self.dtype = dtype
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors report it
        self._length = 0
        self._step = StepCounters()
        self._cuda_before: dict[str, int] = {}
        self._report: MemoryReport | None = None  # built on first request: subclasses allocate after this
        self._undo: dict | None = None  # the bookkeeping before the current step (see rollback)
        self._undo_data: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []  # held slots a step overwrote

    @property
    def length(self) -> int:
        """Number of leading positions whose keys and values are held."""
        return self._length

    @property
    def capacity(self) -> int | None:
        """Most positions the cache can hold, or ``None`` when unbounded."""
        return None

    def check_write(self, pos: int, q_len: int, batch_size: int) -> None:
        """Raise, before anything is written, if ``q_len`` positions cannot be written at ``pos``."""
        if batch_size != self.batch_size:
            raise SettingsError(
                f"batch of {batch_size} sequences but the cache was made for batch_size={self.batch_size}; "
                f"make a cache with batch_size={batch_size}"
            )
        if pos < 0 or pos > self.length:
            raise SettingsError(
                f"write at position {pos} but the cache holds {self.length} positions; writes must start at or "
                f"before the end (pos <= {self.length}) so no slot is left unwritten"
            )

    def begin_step(self) -> None:
        """Start counting a forward pass's writes, copies and allocations (after ``check_write`` passed), and save
        what :meth:`rollback` needs to undo the step."""
        self._undo, self._undo_data = self._snapshot(), []
        self._step = StepCounters()
        self._cuda_before = cuda_stats(self.device)

    def _snapshot(self) -> dict:
        """The bookkeeping a step may change, as copies (subclasses add theirs)."""
        return {"_length": self._length, "_step": self._step, "_report": self._report,
                "_cuda_before": self._cuda_before}

    def _restore(self, snapshot: dict) -> None:
        for name, value in snapshot.items():
            setattr(self, name, value)

    def _keep(self, t: torch.Tensor, dim: int, start: int, n: int) -> None:
        """Save ``t.narrow(dim, start, n)`` before the step overwrites it in place (held data only)."""
        if self._undo is not None and n > 0:
            self._undo_data.append((t, dim, start, t.narrow(dim, start, n).clone()))

    @property
    def undo_length(self) -> int:
        """The length before the current step began (what a rollback returns to)."""
        return self._length if self._undo is None else self._undo["_length"]

    def settle(self) -> None:
        """Forget how to undo the last step: from here on :meth:`rollback` does nothing until a step begins."""
        self._undo, self._undo_data = None, []

    def rollback(self) -> None:
        """Undo the last step (written or committed) exactly: length, slots, memory report, held keys and values.
        Does nothing when there is no step to undo (none began, or it was already rolled back)."""
        if self._undo is None:
            return
        for t, dim, start, saved in reversed(self._undo_data):
            t.narrow(dim, start, saved.shape[dim]).copy_(saved)
        self._restore(self._undo)
        self._undo, self._undo_data = None, []

    @abstractmethod
    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``(B, kv_heads, q_len, hd)`` for positions ``pos..pos+q_len-1`` of ``layer`` and
        return the keys/values attention must read, ``(B, kv_heads, pos + q_len, hd)``."""

    def commit(self, end: int) -> None:
        """Record that every layer now holds positions ``0..end-1`` (called once per forward pass)."""
        self._length = end
        self._report = self._make_report()  # now: the CUDA deltas are the step's

    def memory_report(self) -> MemoryReport:
        """Memory after the last forward pass (its writes, copies and allocations) or after a rewind."""
        if self._report is None:
            self._report = self._make_report()
        return self._report

    def _make_report(self) -> MemoryReport:
        after = cuda_stats(self.device)
        deltas = {k: after[k] - self._cuda_before.get(k, after[k]) for k in after}
        s = self._step
        return MemoryReport(
            length=self.length, logical_bytes=self.used_bytes, reserved_bytes=self.reserved_bytes,
            analytic_bytes=kv_bytes(self.config, self.held, self.batch_size, self.dtype),
            written_bytes=s.written_bytes, copied_bytes=s.copied_bytes, allocated_bytes=s.allocated_bytes,
            freed_bytes=s.freed_bytes, allocations=s.allocations, frees=s.frees, cuda=deltas, cuda_now=after,
            layers=self.config.num_layers)

    def check_truncate(self, n: int) -> None:
        """Raise, changing nothing, if the cache cannot be truncated to ``n`` positions (so several caches can be
        checked before any is rewound)."""
        if not 0 <= n <= self.length:
            raise SettingsError(f"cannot truncate to {n}: the cache holds {self.length} positions (0 <= n <= {self.length})")

    def truncate(self, n: int) -> None:
        """Rewind: keep only the first ``n`` positions. Storage is not cleared; the length moves back."""
        self.check_truncate(n)
        self._length = n
        self._step = StepCounters()
        self._report = None
        self._undo, self._undo_data = None, []

    @abstractmethod
    def clone(self) -> "KVCache":
        """An independent copy: writes to either never show in the other."""

    def fork(self) -> "KVCache":
        """A cache for a second sequence continuing from this one's prefix. By default an independent copy;
        strategies that can share storage (the paged cache) share it until the sequences diverge."""
        self._check_forkable()
        return self.clone()

    def _check_forkable(self) -> None:
        if self.length == 0:
            raise SettingsError(f"cannot fork an empty {type(self).__name__}: there is no prefix to share; "
                             f"make a new cache instead")

    def storage(self, layer: int) -> list[torch.Tensor]:
        """The tensors that hold ``layer``'s cache (a read that shares their memory is a view, not a copy)."""
        return []

    def read_positions(self) -> list[int]:
        """The position of each key column the last forward pass read, in the order attention saw them
        (``0 .. length-1`` unless the strategy reads in storage order)."""
        return list(range(self.length))

    def stored_error(self, layer: int) -> torch.Tensor | None:
        """How far what this cache stores for ``layer`` is from what the model wrote: ``(kv_heads, length)`` max
        absolute error per position, on the CPU, for the first sequence of the batch; None for a cache that stores
        keys and values exactly (every cache but the quantized one)."""
        return None

    @abstractmethod
    def slot_view(self) -> SlotView:
        """The state of every physical slot (what the cache map draws)."""

    @property
    @abstractmethod
    def reserved_bytes(self) -> int:
        """Bytes of storage the cache holds now, used or not."""

    @property
    def held(self) -> int:
        """Positions whose keys and values the cache holds (``length``, unless the strategy evicts)."""
        return self.length

    @property
    def used_bytes(self) -> int:
        """Bytes of the slots that hold valid positions."""
        return kv_bytes(self.config, self.held, self.batch_size, self.dtype)

    def __repr__(self) -> str:
        cap = "unbounded" if self.capacity is None else self.capacity
        return (f"{type(self).__name__}(length={self.length}, capacity={cap}, batch_size={self.batch_size}, "
                f"dtype={self.dtype}, device={self.device}, reserved={self.reserved_bytes} B)")
