"""The explorer's attention of one lane, bounded: what the views draw, not every layer's and head's full matrix.

For every layer and query head :class:`AttentionStore` keeps a binned **overview** of all query rows x key positions
(max and mean per aligned power-of-two bin, :mod:`kvexplore.views.bins`; neighbouring bins merge as the rows or keys
outgrow them), the newest ``recent`` rows at full resolution (logical position order, 0 where not read), and per row
bin the learned sinks' share of its rows. What that holds, its **bound** (:meth:`AttentionStore.bound`, whatever the
number of steps) and how a zoom recomputes the rest (:mod:`.recompute`): docs/tracing.md ("The explorer's attention:
a bounded store").

A rewind is seen when a step writes rows at or before ones held: the rows from there on are dropped. A row bin that
mixed kept and dropped rows is rebuilt from the kept rows still held at full resolution (the newest); kept rows
older than those leave that one bin (its max and mean are then over the rows it still holds).
"""

from __future__ import annotations

import numpy as np
import torch

from ..core import host
from ..views import attention
from .rowbins import causal_cells, even as _even, merged as _merged, padded as _padded, reduce_rows

ROW_BINS, COL_BINS, RECENT = attention.ROW_BINS, 512, 8  # row bins: as many as the history heatmap draws
_TORCH = {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16}


class AttentionStore:
    """The bounded attention of one lane (see the module's docstring for what is kept and the bound)."""

    bounded = True  # as a StepTrace's history: a binned overview and the newest rows, not every row (AttentionHistory)

    def __init__(self, row_bins: int | None = None, col_bins: int | None = None, recent: int | None = None,
                 layers: int = 4) -> None:
        self.row_bins, self.col_bins = row_bins or ROW_BINS, col_bins or COL_BINS
        self.recent = recent or RECENT
        self._capacity = layers  # layers room is made for at first
        self.rs = self.cs = 1  # the overview's bin sizes (rows, keys)
        self.rows = 0  # query rows held: positions 0 .. rows - 1
        self.heads = 0
        self._index: dict[int, int] = {}  # layer -> its index in the arrays below (layers stacked)
        self._max = np.zeros((0, 0, 0, 0), dtype=np.float32)  # (layers, heads, row bins, key bins), NaN: no cell
        self._mean = np.zeros((0, 0, 0, 0), dtype=np.float16)  # the same, float16
        self._sink = np.zeros((0, 0, 0, 2), dtype=np.float32)  # (layers, heads, row bins, 2): the sinks' max, sum
        self._count = np.zeros((0, 0), dtype=np.int64)  # cells per bin (the same for every layer and head)
        self._rowcount = np.zeros(0, dtype=np.int64)  # rows per row bin
        self._recent = np.zeros((0, self.recent, 0, 0), dtype=np.float32)  # (layers, recent, heads, width)
        self._recent_q = np.zeros((0, self.recent), dtype=np.int64)  # the query position in each slot (-1: none):
        # row q at q % recent
        self._before: tuple[np.ndarray, np.ndarray] | None = None  # counts before the step under way
        self._step = (0, 0)  # the query positions of the step under way
        self._pending: list = []  # [layer index, chunks...]: one layer's chunks of a long step, landed together
        self._cells: dict[tuple, np.ndarray] = {}  # the cells a step's rows add, per block (the same in every layer)

    # -- writing ---------------------------------------------------------------------------------------------
    def begin(self, q0: int, q1: int) -> None:
        """Rows ``q0 .. q1 - 1`` are about to land (every layer's): drop rows from ``q0`` on (a rewind), grow the
        bins so ``q1`` rows and keys fit."""
        if q0 < self.rows:
            self.truncate(q0)
        self.rows = max(q0, self.rows)
        while -(-q1 // self.rs) > self.row_bins:
            self._merge_rows()
        while -(-q1 // self.cs) > self.col_bins:
            self._merge_cols()
        self._grow(-(-q1 // self.rs), -(-q1 // self.cs))
        self._before = (self._count.copy(), self._rowcount.copy())
        self._step = (q0, q1)
        self._cells = {}

    def add(self, layer: int | list[int], q0: int, probs: torch.Tensor, positions: np.ndarray | range | None = None,
            c0: int = 0) -> None:
        """Land ``probs`` ``(heads, rows, keys)`` (float32, any device) of query positions ``q0..`` of ``layer`` (or
        ``(layers, heads, rows, keys)`` of a list of layers): key column ``j`` is position ``c0 + j``, or
        ``positions[j]`` when given (any order), or ``positions[kv, j]`` for the query heads of KV head ``kv`` when
        given one row per KV head (-1: a column that head does not hold)."""
        layers = [layer] if isinstance(layer, int) else list(layer)
        probs = probs.detach().float().reshape(len(layers), *probs.shape[-3:])
        if positions is not None:
            positions = np.asarray(positions, dtype=np.int64)
            if positions.ndim == 2:  # one row per KV head (a pressed layer's heads hold different positions)
                probs, positions, c0 = _by_head(probs, positions), None, 0
            elif positions.size and np.array_equal(positions, np.arange(positions[0], positions[0] + positions.size)):
                c0, positions = int(positions[0]), None
        if positions is not None:  # scattered: to logical order first
            width = int(positions.max()) + 1 if positions.size else 0
            logical = probs.new_zeros(*probs.shape[:3], width)
            logical[..., host.upload(positions, probs.device)] = probs
            probs, c0 = logical, 0
        piece = self._reduced(probs, q0, c0)
        idx = np.asarray([self._slot(n, probs.shape[1]) for n in layers], dtype=np.int64)
        self._keep_recent(idx, q0, probs, c0)
        if len(layers) == 1 and (q0 + probs.shape[2]) % self.rs == 0:
            if self._pending and self._pending[0] != idx[0]:
                self._flush()
            if not self._pending:
                self._pending = [int(idx[0])]
            self._pending.append(piece)  # a chunk of a long step: the layer's chunks land together
            return
        self._flush()
        self._land(idx, *piece)

    def _reduced(self, probs: torch.Tensor, q0: int, c0: int) -> tuple:
        """``probs`` ``(layers, heads, rows, keys)`` reduced to the overview's bins, as :meth:`_land` takes them."""
        L, H, C, W = probs.shape
        rb0, cb0, mx, sm, rowsum = reduce_rows(probs.reshape(L * H, C, W), q0, c0, self.rs, self.cs)
        mx, sm, rowsum = (t.numpy().reshape(L, H, *t.shape[1:]) for t in host.fetch([mx, sm, rowsum]))  # (small)
        return q0, rb0, cb0, mx, sm, rowsum

    def _flush(self) -> None:
        """Land the chunks of one layer kept so far as one block (they cover whole, consecutive row bins)."""
        if not self._pending:
            return
        layer, *pieces = self._pending
        self._pending = []
        q0, rb0 = pieces[0][0], pieces[0][1]
        rb1 = max(p[1] + p[3].shape[2] for p in pieces)
        cb0 = min(p[2] for p in pieces)
        cb1 = max(p[2] + p[3].shape[3] for p in pieces)
        H = pieces[0][3].shape[1]
        mx = np.zeros((1, H, rb1 - rb0, cb1 - cb0), dtype=np.float32)
        sm = np.zeros_like(mx)
        for _, rb, cb, m, s_, _ in pieces:  # columns outside a chunk's span were masked: probability 0
            mx[:, :, rb - rb0: rb - rb0 + m.shape[2], cb - cb0: cb - cb0 + m.shape[3]] = m
            sm[:, :, rb - rb0: rb - rb0 + m.shape[2], cb - cb0: cb - cb0 + m.shape[3]] = s_
        self._land(np.asarray([layer]), q0, rb0, cb0, mx, sm, np.concatenate([p[5] for p in pieces], -1))

    def end(self) -> None:
        """The step's rows have landed in every layer: count their cells."""
        self._flush()
        q0, q1 = self._step
        nrb, ncb = self._count.shape
        self._count += causal_cells(q0, q1, self.rs, 0, nrb, self.cs, 0, ncb)
        np.add.at(self._rowcount, np.arange(q0, q1) // self.rs, 1)
        self.rows = max(self.rows, q1)
        self._before = None

    def _land(self, idx, q0, rb0, cb0, mx, sm, rowsum) -> None:
        C = rowsum.shape[-1]
        nrb = mx.shape[2]
        ncb = min(mx.shape[3], self._count.shape[1] - cb0)
        mx, sm = mx[..., :ncb], sm[..., :ncb]
        rows, cols = slice(rb0, rb0 + nrb), slice(cb0, cb0 + ncb)
        layers = _as_slice(idx)  # a slice gives views: updated in place
        before = self._before[0][rows, cols]
        key = (q0, C, self.rs, rb0, nrb, self.cs, cb0, ncb)
        if key not in self._cells:  # the same for every layer of the step
            self._cells[key] = causal_cells(q0, q0 + C, self.rs, rb0, nrb, self.cs, cb0, ncb)
        added = self._cells[key]
        total = (before + added).astype(np.float32)
        inv = np.divide(1.0, total, out=np.zeros_like(total), where=total > 0)
        if not before.any():  # bins no earlier row reached (a prefill's): no old mean to weigh, no old max
            # (converted to float16 by torch: numpy's conversion is several times slower)
            self._mean[layers, :, rows, cols] = (torch.from_numpy(sm) * torch.from_numpy(inv)).half().numpy()
            self._max[layers, :, rows, cols] = torch.from_numpy(mx).to(_TORCH[self._max.dtype]).numpy()
        else:  # in torch too: numpy's float16 arithmetic and conversions are slower (docs/benchmarks.md)
            old = torch.from_numpy(self._mean[layers, :, rows, cols]).float()
            weight = torch.from_numpy(before.astype(np.float32))
            mean = (old * weight + torch.from_numpy(sm)) * torch.from_numpy(inv)
            self._mean[layers, :, rows, cols] = mean.half().numpy()
            M = torch.from_numpy(self._max[layers, :, rows, cols])
            self._max[layers, :, rows, cols] = torch.maximum(M, torch.from_numpy(mx).to(M.dtype)).numpy()
        share = 1.0 - rowsum  # (L, H, C): what the learned sinks took of each row
        b = np.arange(q0, q0 + C) // self.rs
        starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
        at = b[starts]
        sink = self._sink[layers][:, :, at]  # (L, H, bins, 2)
        sink[..., 0] = np.maximum(sink[..., 0], np.maximum.reduceat(share, starts, axis=-1))
        sink[..., 1] += np.add.reduceat(share, starts, axis=-1)
        self._sink[layers, :, at[0]: at[-1] + 1] = sink

    def _keep_recent(self, idx: np.ndarray, q0: int, probs: torch.Tensor, c0: int) -> None:
        C = probs.shape[2]
        first = max(q0, self._step[1] - self.recent) - q0
        if first >= C:
            return
        rows = host.fetch([probs[:, :, first:]])[0].numpy()  # (L, H, r, keys)
        width, room = c0 + rows.shape[3], self._recent.shape[3]
        if width > room:
            self._recent = _padded(self._recent, (*self._recent.shape[:3], max(width, room * 5 // 4)), 0.0)
        layers = _as_slice(idx)
        for i in range(rows.shape[2]):
            q = q0 + first + i
            slot = q % self.recent
            if c0:
                self._recent[layers, slot, :, :c0] = 0.0
            self._recent[layers, slot, :, c0:width] = rows[:, :, i]
            self._recent[layers, slot, :, width:] = 0.0
            self._recent_q[layers, slot] = q

    # -- reading ---------------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return sorted(self._index)

    def has(self, layer: int) -> bool:
        return layer in self._index and self.rows > 0

    def row(self, layer: int, q: int) -> np.ndarray | None:
        """``(heads, q + 1)`` float32: query position ``q``'s attention over key positions ``0..q`` (0 where not
        read), or None when it is not among the recent rows held."""
        i = self._index.get(layer)
        if i is None or q < 0 or self._recent_q[i, q % self.recent] != q:
            return None
        out = self._recent[i, q % self.recent, :, : q + 1]
        return np.pad(out, ((0, 0), (0, q + 1 - out.shape[1]))) if out.shape[1] < q + 1 else out

    def holds(self, entry: tuple[int, int, int]) -> bool:
        """Whether the rows of a step's entry ``(layer, first query position, end)`` are all still held."""
        layer, q0, q1 = entry
        return q1 - q0 <= self.recent and all(self.row(layer, q) is not None for q in range(q0, q1))

    def clip(self, entry: tuple[int, int, int], n: int) -> tuple[int, int, int]:
        return entry[0], entry[1], min(entry[2], n)  # the entry's rows of query positions below n

    def get(self, entry: tuple[int, int, int], reads) -> torch.Tensor:
        """``(rows, heads, len(reads))``: the entry's rows over the key positions ``reads`` (in that order), as
        :meth:`~kvexplore.trace.tracer.StepTrace.attention_raw` gives them."""
        layer, q0, q1 = entry
        cols = np.asarray(list(reads), dtype=np.int64)
        width = max(q1, int(cols.max()) + 1 if cols.size else 0)
        rows = []
        for q in range(q0, q1):
            r = self.row(layer, q)
            if r is None:
                raise KeyError(f"layer {layer}'s attention of query position {q} is no longer held (the explorer "
                               f"keeps the newest {self.recent} rows at full resolution)")
            rows.append(np.pad(r, ((0, 0), (0, width - r.shape[1])))[:, cols])
        return torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, self.heads, cols.size)

    def recent_rows(self, layer: int) -> list[int]:
        """The query positions held at full resolution, oldest first."""
        i = self._index.get(layer)
        return [] if i is None else sorted(int(q) for q in self._recent_q[i] if 0 <= q < self.rows)

    def overview(self, layer: int, head: int, rs: int, cs: int, r0: int, nr: int, c0: int, nc: int):
        """``(max, mean, cells)`` ``(nr, nc)`` of bins of sizes ``rs`` x ``cs`` (multiples of the stored ones)
        starting at row bin ``r0`` and key bin ``c0`` (in those sizes), up to the rows held; NaN where no cell."""
        i = self._index[layer]
        fr, fc = rs // self.rs, cs // self.cs
        M = _block(self._max[i, head], r0 * fr, nr * fr, c0 * fc, nc * fc, 0.0)
        A = _block(self._mean[i, head].astype(np.float32), r0 * fr, nr * fr, c0 * fc, nc * fc, 0.0)
        N = _block(self._count.astype(np.float64), r0 * fr, nr * fr, c0 * fc, nc * fc, 0.0)
        M = M.reshape(nr, fr, nc, fc)
        A, N = A.reshape(nr, fr, nc, fc), N.reshape(nr, fr, nc, fc)
        cells = N.sum((1, 3))
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (A * N).sum((1, 3)) / cells
            mx = np.where(cells > 0, M.max((1, 3)), np.nan)
        return mx.astype(np.float32), np.where(cells > 0, mean, np.nan).astype(np.float32), cells

    def sink_share(self, layer: int, head: int, rs: int, r0: int, nr: int) -> tuple[np.ndarray, np.ndarray]:
        """Per row bin (size ``rs``, a multiple of the stored one, from bin ``r0``): the max and mean share of the
        learned sinks in its rows."""
        f = rs // self.rs
        s = _block(self._sink[self._index[layer], head].T.copy(), 0, 2, r0 * f, nr * f, 0.0).reshape(2, nr, f)
        n = _block(self._rowcount[None].astype(np.float64), 0, 1, r0 * f, nr * f, 0.0).reshape(nr, f).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return s[0].max(1), np.where(n > 0, s[1].sum(1) / n, np.nan)

    def bound(self, layers: int, heads: int, context: int) -> int:
        """The most bytes this store holds for ``layers`` x ``heads`` at ``context`` tokens (the docstring's bound,
        with the arrays' room for growth: layers and the recent rows' width are allocated by doubling)."""
        cap = max(self._capacity, 1 << max(0, layers - 1).bit_length())
        R, K = self.row_bins, self.col_bins
        width = max(64, context * 5 // 4 + 1)
        return cap * heads * (R * K * 6 + R * 8 + self.recent * width * 4) + cap * self.recent * 8 + R * K * 8 + R * 8

    @property
    def nbytes(self) -> int:
        """Bytes held (overview, sinks, counts, recent rows)."""
        arrays = [self._max, self._mean, self._sink, self._recent, self._recent_q, self._count, self._rowcount]
        return sum(a.nbytes for a in arrays)

    # -- bins ------------------------------------------------------------------------------------------------
    def _slot(self, layer: int, heads: int) -> int:
        """The index of ``layer`` in the stacked arrays (added on its first rows)."""
        if layer in self._index:
            return self._index[layer]
        if not self._index:
            self.heads = heads
            R, K = self._count.shape
            self._max = np.zeros((0, heads, R, K), dtype=self._max_dtype)
            self._mean = np.zeros((0, heads, R, K), dtype=np.float16)
            self._sink = np.zeros((0, heads, R, 2), dtype=np.float32)
            self._recent = np.zeros((0, self.recent, heads, 64), dtype=np.float32)
            self._recent_q = np.zeros((0, self.recent), dtype=np.int64)
        if heads != self.heads:
            raise ValueError(f"layer {layer} has {heads} query heads, the store holds {self.heads}")
        n = len(self._index)
        if n == self._max.shape[0]:  # room for more layers: the capacity doubles
            cap = max(self._capacity, 2 * n)
            self._max = _padded(self._max, (cap, *self._max.shape[1:]), 0)
            self._mean = _padded(self._mean, (cap, *self._mean.shape[1:]), 0)
            self._sink = _padded(self._sink, (cap, *self._sink.shape[1:]), 0.0)
            self._recent = _padded(self._recent, (cap, *self._recent.shape[1:]), 0.0)
            self._recent_q = _padded(self._recent_q, (cap, *self._recent_q.shape[1:]), -1)
        self._index[layer] = n
        return n

    @property
    def _max_dtype(self):
        """float32 while the overview is at full resolution (it is then the exact drawing), float16 once binned."""
        return np.float32 if self.rs == self.cs == 1 else np.float16

    def _grow(self, nrb: int, ncb: int) -> None:
        R, K = self._count.shape
        if nrb <= R and ncb <= K:
            return
        R2 = min(self.row_bins, max(nrb, 2 * R)) if nrb > R else R
        K2 = min(self.col_bins, max(ncb, 2 * K)) if ncb > K else K
        self._count = _padded(self._count, (R2, K2), 0)
        self._rowcount = _padded(self._rowcount, (R2,), 0)
        n, H = self._max.shape[:2]
        self._max = _padded(self._max, (n, H, R2, K2), 0)
        self._mean = _padded(self._mean, (n, H, R2, K2), 0)
        self._sink = _padded(self._sink, (n, H, R2, 2), 0.0)

    def _merge_rows(self) -> None:
        """Row bins twice as tall, in the same arrays (:func:`~.rowbins.merged`), the rest empty room."""
        self.rs *= 2
        self._max, self._mean = _merged(self._max, self._mean, self._count, 2, self._max_dtype)
        s = _even(self._sink, 2)
        s = np.stack([np.maximum(s[:, :, 0::2, 0], s[:, :, 1::2, 0]), s[:, :, 0::2, 1] + s[:, :, 1::2, 1]], -1)
        self._sink = _padded(s, self._sink.shape, 0.0)
        c = _even(self._count, 0)
        self._count = _padded(c[0::2] + c[1::2], self._count.shape, 0)
        r = _even(self._rowcount, 0)
        self._rowcount = _padded(r[0::2] + r[1::2], self._rowcount.shape, 0)

    def _merge_cols(self) -> None:
        self.cs *= 2
        self._max, self._mean = _merged(self._max, self._mean, self._count, 3, self._max_dtype)
        c = _even(self._count, 1)
        self._count = _padded(c[:, 0::2] + c[:, 1::2], self._count.shape, 0)

    def truncate(self, n: int) -> None:
        if n >= self.rows:
            return
        b = n // self.rs  # the bin that may keep some rows
        self._count[b:] = 0
        self._rowcount[b:] = 0
        self._max[:, :, b:] = 0.0
        self._mean[:, :, b:] = 0.0
        self._sink[:, :, b:] = 0.0
        self._recent_q[self._recent_q >= n] = -1
        self.rows = b * self.rs
        first = n  # the rows of the cut bin still held at full resolution (the newest: a tail) land again
        while first > b * self.rs and all(self.row(layer, first - 1) is not None for layer in self._index):
            first -= 1
        kept = range(first, n)
        if kept and self._index:
            self._step = (kept.start, n)
            self._before = (self._count.copy(), self._rowcount.copy())
            rows = np.stack([self._recent[: len(self._index), q % self.recent] for q in kept], 2)  # (L, H, rows, W)
            self._land(np.arange(len(self._index)), *self._reduced(torch.from_numpy(rows), kept.start, 0))
            self.end()


def _by_head(probs: torch.Tensor, positions: np.ndarray) -> torch.Tensor:
    """``probs`` ``(layers, heads, rows, keys)`` over columns whose positions differ per KV head (``positions``
    ``(kv_heads, keys)``, -1 for none) put in position order: ``(layers, heads, rows, last position + 1)``."""
    heads, kv = probs.shape[1], positions.shape[0]
    positions = np.repeat(positions[:, :probs.shape[-1]], heads // kv, axis=0)  # each query head reads its KV head's
    width = int(positions.max()) + 1 if positions.size else 0
    out = probs.new_zeros(*probs.shape[:3], max(width, 0))
    for h in range(heads):
        cols = np.flatnonzero(positions[h] >= 0)
        out[:, h, :, host.upload(positions[h][cols], probs.device)] = \
            probs[:, h, :, host.upload(cols, probs.device)]
    return out


def _as_slice(idx: np.ndarray):
    """Consecutive layer indices as a slice (indexing with it gives views), else the indices."""
    first = int(idx[0])
    return slice(first, first + len(idx)) if np.array_equal(idx, np.arange(first, first + len(idx))) else idx


def _block(a: np.ndarray, r0: int, nr: int, c0: int, nc: int, fill: float) -> np.ndarray:
    out = np.full((nr, nc), fill, dtype=a.dtype)
    src = a[r0: r0 + nr, c0: c0 + nc]
    out[: src.shape[0], : src.shape[1]] = src
    return out
