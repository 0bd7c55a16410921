"""A model run over several processes with this one as rank 0: what an explorer lane ``tp:N`` or ``cp:N`` steps.

:class:`Leader` spawns ranks 1..N-1 (each loads the model by its name or folder and holds its shard and its own
cache) and joins them in a group of its own (:func:`~.worker.group_at`: not the process's default group, so a kernel
can lead several lanes, and a group whose rank died is simply dropped). Rank 0's model and cache are ordinary
kvexplore objects in this process, stepped by an ordinary :class:`~kvexplore.Generator` through :class:`Leading`,
the executor that sends each pass to the other ranks before rank 0 computes it: the explorer's cache map, attention
and memory views draw rank 0 as they draw any lane, and every step's trace keeps every rank's part
(:class:`~kvexplore.trace.ranks.RankStep`) for the ranks' view and the replay.

The other ranks follow rank 0's cache: each pass names its position, and a rank whose cache is longer (after a rewind
or an undone step) cuts it back first. A rank that dies makes rank 0's collective fail at once (its connection
closes); one that hangs makes it fail after ``timeout_s``: either way every rank is stopped and
:class:`~kvexplore.errors.RankError` names the rank, within that bound. Closing (``close()``, the lane let go, the
kernel's exit or restart) stops them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..errors import SettingsError
from ..models.model import Model
from ..runtime.eager import EagerExecutor
from ..trace.ranks import RankShare, RankStep
from .ranks import START_TIMEOUT_S, ContextParallel, Pass, Ranks, RankError, TensorParallel

#: the splits a lane may ask for: ``tp:N`` and ``cp:N``
SPLITS = {"tp": TensorParallel, "cp": ContextParallel}


def parse(strategy: str) -> tuple[str, int] | None:
    """``"tp:3"`` -> ``("tp", 3)``; None for a name that is not a split (``"preallocated"``, ``"tp:"``, ``"tp:x"``)."""
    mode, _, n = strategy.partition(":")
    if mode not in SPLITS or not n.isdigit():
        return None
    return mode, int(n)


class Leader(Ranks):
    """``model`` split ``mode`` (``"tp"`` or ``"cp"``) over ``n`` ranks, this process rank 0. ``new_cache()`` is rank
    0's cache (the other ranks make theirs alike); :class:`Leading` is the executor a generator steps it with."""

    first = 1

    def __init__(self, model: Model, mode: str, n: int, cache: str = "preallocated", max_seq_len: int = 256,
                 interleave: int = 1, timeout_s: float = 10.0, threads: int = 1, **cache_options: Any) -> None:
        if not isinstance(model, Model) or not isinstance(model.source, str):
            raise SettingsError("a lane over several processes runs a model loaded by name or folder (kvexplore.load"
                                "(...)): each rank loads it again, so a model built in memory cannot be split")
        if n < 2:
            raise SettingsError(f"{mode}:{n}: a split needs at least 2 ranks (tp:2, cp:3)")
        split = SPLITS[mode]
        self.mode, self.what, self.collective = split.mode, split.what, split.collective
        self.check = split.check
        self.full = model
        self.model0: Model | None = None
        self.layout = None
        self.slots = max_seq_len
        if mode == "cp":
            cache = "context-parallel"
        super().__init__(model.source, n, cache, max_seq_len, str(model.dtype).removeprefix("torch."), timeout_s,
                         threads, interleave, **cache_options)

    again = "Reset or Prefill starts the lane's ranks again"

    def _meet(self, port: int) -> None:
        """Join the ranks as rank 0, watching them meanwhile: one that fails before the meeting (it cannot load the
        model, say) is reported at once, not after the meeting's timeout."""
        from .worker import group_at

        met: dict[str, Any] = {}

        def meet() -> None:
            try:
                met["group"] = group_at(port, 0, self.tp, self.timeout_s, START_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 (said below)
                met["error"] = e

        waiting = threading.Thread(target=meet, name="kvexplore rank 0 meeting", daemon=True)
        waiting.start()
        while waiting.is_alive():
            waiting.join(0.05)
            if waiting.is_alive() and not all(p.is_alive() for p in self.processes):
                self._gather("start", 2.0)  # the rank's own error, or its exit: named, and every rank stopped
        if "error" in met:
            e = met["error"]
            self._fail(f"the ranks did not meet ({type(e).__name__}: {str(e).splitlines()[0]})")
        self._store, self.group = met["group"]
        self.model0 = self._rank0()

    def _rank0(self) -> Model:
        """Rank 0's model, from the model in this process (its weights shared or sliced, the model itself kept)."""
        full = self.full
        if self.mode == "tp":
            from .shard import shard_model
            from .split import split

            return shard_model(full, split(full.config, self.tp, 0), self.group)
        from .context import Layout, context_parallel

        twin = Model.skeleton(full.config)
        twin.load_state_dict(full.state_dict(), assign=True, strict=True)  # the same tensors: nothing copied
        twin.rotary, twin.tokenizer, twin.source = full.rotary, full.tokenizer, full.source
        self.layout = Layout(self.tp, self.interleave, 0)
        return context_parallel(twin.eval(), self.layout, self.group)

    def new_cache(self) -> Any:
        """Rank 0's cache, made as the other ranks made theirs."""
        if self.layout is not None:
            from .context import ContextParallelCache

            return ContextParallelCache(self.model0.config, self.slots, self.layout, dtype=self.model0.dtype)
        from ..caches.factory import make_cache

        return make_cache(self.cache_kind, self.model0, max_seq_len=self.slots, **self.cache_options)

    def lead(self, ids: torch.Tensor, cache: Any, pos: int, **step: Any) -> torch.Tensor:
        """One pass: the other ranks told first (the ids and the position), then rank 0's own; every rank's part
        noted on the step's trace (``step["tracer"]``)."""
        from .worker import memory

        feed = [int(t) for t in ids.reshape(-1)]
        start = time.perf_counter()
        self._send("forward", feed, pos)
        before = self.model0.traffic.copy()
        try:
            logits = self.model0(ids, cache, pos, **step)
        except RuntimeError as e:  # a collective failed: a rank died (at once) or hung (after timeout_s)
            self._gather("forward", 2.0)  # names the rank that stopped or did not answer, and stops them all
            self._fail(f"rank 0's pass failed in a collective ({str(e).splitlines()[0][:200]})")
        answers = self._gather("forward", self.timeout_s)
        step_pass = Pass(pos, len(feed), time.perf_counter() - start,
                         [self.model0.traffic.since(before), *[a[1] for a in answers]])
        self.steps.append(step_pass)
        self._memory = [memory(self.model0, cache), *[a[2] for a in answers]]
        tracer = step.get("tracer")
        if tracer is not None and hasattr(tracer, "note_ranks"):
            tracer.note_ranks(self.rank_step(step_pass, cache.length))
        return logits

    def forward(self, ids: Any) -> torch.Tensor:
        raise SettingsError("a Leader's passes are its lane's generator's (Generator(Leading(leader), "
                            "leader.new_cache())); for a driver of its own use TensorParallel or ContextParallel")

    truncate = forward  # the other ranks follow rank 0's cache at the next pass

    def memory(self) -> list[dict[str, Any]]:
        """Every rank's bytes after the last pass (rank 0's included; before any pass, the other ranks' only)."""
        return [dict(m) for m in self._memory]

    def rank_step(self, step: Pass, length: int) -> RankStep:
        """Every rank after ``step`` (what the trace keeps)."""
        shares = tuple(RankShare(m["rank"], m["describe"], int(m["held_bytes"]),
                                 tuple(m["kv_heads"]) if m["kv_heads"] is not None else None, int(m["replicas"]),
                                 t.calls, t.bytes, t.seconds)
                       for m, t in zip(self._memory, step.traffic))
        return RankStep(self.mode, self.what, self.collective, step.position, step.tokens, step.seconds, length, shares,
                        self._memory[0]["model_kv_heads"], self.interleave)


class Leading(EagerExecutor):
    """The executor of a lane over several processes: rank 0's model, each pass led through :class:`Leader`."""

    def __init__(self, leader: Leader) -> None:
        super().__init__(leader.model0)
        self.leader = leader

    def __call__(self, ids: torch.Tensor, cache: Any, pos: int, tracer: Any = None, last_only: bool = False,
                 keep_undo: bool = False) -> torch.Tensor:
        return self.leader.lead(ids, cache, pos, tracer=tracer, last_only=last_only, keep_undo=keep_undo)

    def compile_refusal(self, cache: Any) -> str | None:
        return "a lane over several processes runs eagerly (its collectives are between the passes' layers)"

    def close(self) -> None:
        self.leader.close()

    def __repr__(self) -> str:
        return f"Leading({self.leader.what}, {self.leader.tp} ranks)"


__all__ = ["Leader", "Leading", "RankError", "SPLITS", "parse"]
