"""The explorer's tracer: a :class:`~kvexplore.Tracer` that keeps, per lane, a bounded attention store
(:class:`~kvexplore.explorer.attention_store.AttentionStore`), the norm of every key and value written (by layer, KV
head and position) and the log-probabilities of the newest token. Attention is taken from kvexplore's model in chunks
of query rows (:mod:`kvexplore.models.observe`) and reduced at once: a long prefill never holds a layer's full matrix
(docs/tracing.md, "The explorer's attention: a bounded store").
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from ..caches.base import KVCache
from ..trace.kept_trace import compact_positions
from ..trace.tracer import StepTrace, Tracer
from .attention_store import AttentionStore

CHUNK = 64  # query rows per chunk of a prefill's attention (at least the store's bin sizes)
SMALL = 4  # blocks of at most this many rows (a decode step's) land together when the step ends
ROWS_KEPT = 65  # a pass of at most this many rows keeps every row's log-probabilities (a verification's k + 1)


class LaneTracer(Tracer):
    """Records everything the views draw: cache events and slots, the attention store, K/V norms, logits."""

    def __init__(self, num_layers: int, num_kv_heads: int, attention: bool = True) -> None:
        # attention=False: a compiled lane's (its steps run as one graph, which no hook sees inside)
        super().__init__(capture={"cache", "memory", "timing"} | ({"attention"} if attention else set()))
        self.history = AttentionStore(layers=num_layers)  # the lane's attention (StepTrace entries refer to it)
        # (layer, k/v, kv head, position); NaN where nothing was recorded (e.g. before the explorer attached, or
        # past a layer's own kv heads when layers differ: num_kv_heads is the most any layer has)
        self.norms = torch.full((num_layers, 2, num_kv_heads, 0), float("nan"))
        self.last_logprobs: torch.Tensor | None = None
        # every row's log-probabilities of the last pass when it had few rows (a speculative verification: row i
        # chose its i-th new token), else its last row only; use_row(i) makes row i the newest token's
        self.row_logprobs: torch.Tensor | None = None
        # linear-attention layers: the norm of each value head's recurrent state, by the sequence length it holds
        self.state_norms: dict[int, dict[int, torch.Tensor]] = {}
        # without a cache every decode step recomputes all rows of attention; only the newest is new (and only it
        # is computed for the record). The session sets this after a prefill.
        self.last_row_only = False
        self._first = 0  # the first query position the step under way records
        # rows that wait for the step's read positions: (layer, first query position, rows, first key column)
        self._hooked: list[tuple[int, int, torch.Tensor, int]] = []
        self._direct: set[int] = set()  # layers whose rows were reduced as they came (read positions 0..end-1)
        self._per_head: dict[int, int] = {}  # layers whose KV heads read different positions -> whose reads
        self._small: list[tuple[int, int, torch.Tensor, int]] = []  # rows of a decode step, landed together
        self.on_layer: Any = None  # called with each layer's number as a pass reaches it (a long prefill's progress)

    @property
    def store(self) -> AttentionStore:
        return self.history

    # -- the chunked protocol of kvexplore.models.observe ----------------------------------------------------
    def row_chunks(self, layer: int, T: int) -> list[int]:
        """Chunk boundaries aligned to the store's row bins (and CHUNK rows), or the newest row only."""
        if self.last_row_only:
            return [T - 1, T]
        size = max(CHUNK, self.history.rs, self.history.cs)
        first = (-self._pos) % size or size
        return [0, *range(min(first, T), T, size), T] if first < T else [0, T]

    @property
    def column_align(self) -> int:
        return self.history.cs

    def observe_rows(self, layer: int, r0: int, probs: torch.Tensor, c0: int, keys: int) -> None:
        """Rows ``r0..`` of ``layer`` over key columns ``c0..`` of the ``keys`` it read. When attention read every
        position so far (the cache's columns are positions ``0..keys-1``: checked when the step ends), the rows are
        reduced now; otherwise they wait for the step's read positions."""
        if self._step is None:
            return
        q0 = self._pos + r0
        self._step.keep_attention(layer, (layer, self._first, self._pos + self._q_len))
        # a pass from an empty cache reads positions 0..end-1 on every head, a pressed layer's too (its press runs
        # after the pass): its rows are reduced now, not held to the step's end (a long prefill's whole matrix)
        if keys == self._pos + self._q_len and (layer not in self._per_head or self._pos == 0):
            self._direct.add(layer)
            if probs.shape[1] <= SMALL:  # a decode step's row: lands with the step, every layer's together
                self.later(probs, lambda h: self._small.append((layer, q0, h, c0)))
            else:
                self.history.add(layer, q0, probs, c0=c0)
        else:
            self.later(probs, lambda h: self._hooked.append((layer, q0, h, c0)))

    # -- hooks -----------------------------------------------------------------------------------------------
    def hook(self, name: str, t: torch.Tensor) -> None:
        # what the views draw is computed on the device here and lands on the host with the rest of the step
        if self._step is not None:
            if name == "logits":
                rows = t[0] if t.shape[1] <= ROWS_KEPT else t[0, -1:]
                self.later(rows.detach().float().log_softmax(-1), self._land_logprobs)
            elif name.endswith(".attn.state"):
                layer, end = int(name.split(".")[1]), self._pos + self._q_len
                self.later(t[0].detach().float().norm(dim=(-2, -1)),
                           lambda h: self.state_norms.setdefault(layer, {}).__setitem__(end, h))
            elif name.endswith((".attn.k_new", ".attn.v_new")):
                layer, which, start = int(name.split(".")[1]), 0 if name.endswith("k_new") else 1, self._pos
                if which == 0 and self.on_layer is not None:
                    self.on_layer(layer)
                self.later(t[0].detach().float().norm(dim=-1), lambda h: self._record_norms(layer, which, start, h))
            elif name.endswith(".attn.probs"):  # attention given whole: into the store once the reads are known
                layer = int(name.split(".")[1])
                rows = t[0, :, -1:] if self.last_row_only else t[0]
                q0 = self._pos + self._q_len - rows.shape[1]
                self.later(rows.float(), lambda h: self._hooked.append((layer, q0, h, 0)))
                return None
        return super().hook(name, t)

    def begin_step(self, cache: KVCache, pos: int, q_len: int) -> None:
        super().begin_step(cache, pos, q_len)
        self._first = pos + q_len - 1 if self.last_row_only else pos
        self._hooked, self._direct, self._small = [], set(), []
        # layers whose KV heads read different positions (a pressed cache): their rows wait for the reads per head
        pressed = set(cache.full_layers) if cache.eviction is not None else set()
        self._per_head = {s.index: s.source if s.shares else s.index for s in cache.plan
                          if (s.source if s.shares else s.index) in pressed}  # layer -> the layer whose reads
        if "attention" in self.capture:
            self.history.begin(self._first, pos + q_len)

    def end_step(self, cache: KVCache) -> StepTrace:
        end = self._pos + self._q_len
        step = super().end_step(cache)
        if "attention" in self.capture:
            # a speculative take-back (the cache kept less than the pass wrote) changed what the cache says it reads:
            # rows that wait for the read positions cannot be placed; they are left out of the store
            hooked = self._hooked if cache.length >= end or not cache.stores else []
            for layer, q0, rows, c0 in hooked:
                if layer in self._per_head:  # one row of positions per KV head
                    by_head = cache.eviction.read_positions_by_head(self._per_head[layer])
                    reads = np.asarray(by_head)[:, c0: c0 + rows.shape[-1]]
                else:
                    reads = list(step.reads_of(layer))[c0: c0 + rows.shape[-1]]
                self.history.add(layer, q0, rows, positions=reads)
                step.keep_attention(layer, (layer, self._first, end))
            groups: dict[tuple, list] = {}
            for layer, q0, rows, c0 in self._small:
                groups.setdefault((q0, c0, tuple(rows.shape)), []).append((layer, rows))
            for (q0, c0, _), items in groups.items():
                self.history.add([n for n, _ in items], q0, torch.stack([r for _, r in items]), c0=c0)
            checked: set[int] = set()
            for layer in self._direct - set(self._per_head):  # reduced as position order: the step must have read
                reads = step.reads_of(layer)  # 0..end-1 (the cache after it: a speculative take-back cut the drafts)
                if id(reads) not in checked and not np.array_equal(np.asarray(reads), np.arange(min(len(reads), end))):
                    raise AssertionError(f"layer {layer} read positions {list(reads[:8])}... not 0..{end - 1}")
                checked.add(id(reads))
            self.history.end()
            if cache.length < end and cache.stores:  # a speculative take-back: the rows of the
                self.history.truncate(cache.length)  # rejected drafts go as a rewind's do; the step keeps the rest
                step.truncate(cache.length)
        self._hooked, self._direct, self._small = [], set(), []
        # the read positions as a range where consecutive (layers of one kind share one)
        compact = {i: compact_positions(r) for i, r in {id(r): r for r in step.layer_reads}.items()}
        step.layer_reads = [compact[id(r)] for r in step.layer_reads]
        return step

    # -- the rest the views draw -----------------------------------------------------------------------------
    def _land_logprobs(self, rows: torch.Tensor) -> None:
        self.row_logprobs, self.last_logprobs = rows, rows[-1]

    def use_row(self, i: int) -> None:
        """Row ``i`` of the last pass gave the newest token (a verification whose later rows were rejected)."""
        if self.row_logprobs is not None and -len(self.row_logprobs) <= i < len(self.row_logprobs):
            self.last_logprobs = self.row_logprobs[i]

    def _record_norms(self, layer: int, which: int, start: int, norms: torch.Tensor) -> None:
        """``norms`` (kv heads, positions from ``start``) of one layer's new keys (0) or values (1)."""
        end = start + norms.shape[1]
        if end > self.norms.shape[-1]:
            grown = torch.full((*self.norms.shape[:-1], max(end, 2 * self.norms.shape[-1], 64)), float("nan"))
            grown[..., : self.norms.shape[-1]] = self.norms
            self.norms = grown
        self.norms[layer, which, : norms.shape[0], start:end] = norms

    def adopt(self, source: "LaneTracer", source_step: StepTrace, step: StepTrace) -> None:
        """``step`` reused the pass ``source`` recorded as ``source_step`` (the same keys, values and masks, checked:
        :mod:`~kvexplore.explorer.shared_pass`): its attention is that pass's, a copy of ``source``'s store."""
        self.history = copy.deepcopy(source.history)
        step.adopt_attention(source_step, self.history)

    def clone(self) -> "LaneTracer":
        """A tracer for a forked lane: the norms and the attention store so far (copies), its own from now on."""
        twin = LaneTracer(self.norms.shape[0], self.norms.shape[2], "attention" in self.capture)
        twin.norms = self.norms.clone()
        twin.state_norms = {layer: dict(by_end) for layer, by_end in self.state_norms.items()}
        twin.history = copy.deepcopy(self.history)
        return twin

    def state_history(self, layer: int, length: int) -> tuple[list[int], torch.Tensor] | None:
        """The sequence lengths at which ``layer``'s state was recorded (at most ``length``: later ones were
        rewound) and the norm of each value head's state then, ``(steps, heads)``; None for a layer without."""
        by_end = {n: v for n, v in self.state_norms.get(layer, {}).items() if n <= length}
        if not by_end:
            return None
        ends = sorted(by_end)
        return ends, torch.stack([by_end[n] for n in ends])
