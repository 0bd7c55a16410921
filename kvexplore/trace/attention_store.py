"""The explorer's attention of one lane, bounded: what the views draw, not every layer's and head's full matrix.

For every layer and query head :class:`AttentionStore` keeps

- an **overview** of all query rows x key positions, binned with aligned power-of-two bins (the bins of
  :mod:`kvexplore.views.bins`): at most ``row_bins`` x ``col_bins`` bins, each bin's max and mean probability in
  float32 and float16 (mean over the bin's causal cells: query ``q`` reads keys ``0..q``). Rows are reduced as soon as a layer
  computes them (the prefill in chunks of query rows, see :mod:`kvexplore.models.observe`); when the rows or keys
  outgrow the bins, neighbouring bins merge (the bin size doubles);
- the **recent rows**: the newest ``recent`` query rows at full resolution (float32, logical position order, 0 where
  a position was not read), which give the current bar (in the cache's physical slot order with the slot view) and
  the zoomed history near the end;
- per row bin, the learned sinks' share of each row (``1 - the row's sum``; 0 for models without sinks).

**Bound**: ``layers x heads x (row_bins x col_bins x 6 B + recent x context x 4 B)`` plus ``row_bins x col_bins x
8 B`` of cell counts -- with the defaults (256 x 512 bins, 8 recent rows) SmolLM2-135M (30 x 9 heads) holds at most
203 MiB of overview and 34 MiB of recent rows at 4,096 tokens; Gemma 3 270M (18 x 4) 54 + 9 MiB. Nothing depends
on how many steps ran. Rows elsewhere at full resolution are recomputed when asked (:mod:`.recompute`).

A rewind is seen when a step writes rows at or before ones held: the rows from there on are dropped (a row bin
that mixed kept and dropped rows is rebuilt from the recent rows when they hold it, otherwise only the rows the
bin still holds count).
"""

from __future__ import annotations

import numpy as np
import torch

from .rowbins import bin_size, causal_cells, reduce_rows

ROW_BINS, COL_BINS, RECENT = 256, 512, 8


class AttentionStore:
    """The bounded attention of one lane (see the module's docstring for what is kept and the bound)."""

    def __init__(self, row_bins: int = ROW_BINS, col_bins: int = COL_BINS, recent: int = RECENT) -> None:
        self.row_bins, self.col_bins, self.recent = row_bins, col_bins, recent
        self.rs = self.cs = 1  # the overview's bin sizes (rows, keys)
        self.rows = 0  # query rows held: positions 0 .. rows - 1
        self.heads = 0
        self._max: dict[int, np.ndarray] = {}  # layer -> (heads, row bins, key bins) float32, NaN: no cell
        self._mean: dict[int, np.ndarray] = {}  # the same in float16
        self._sink: dict[int, np.ndarray] = {}  # layer -> (heads, row bins, 2): max and sum of each row's sink share
        self._count = np.zeros((0, 0), dtype=np.int64)  # cells per bin (the same for every layer and head)
        self._rowcount = np.zeros(0, dtype=np.int64)  # rows per row bin
        self._recent: dict[int, np.ndarray] = {}  # layer -> (recent, heads, width) float32, row q at q % recent
        self._recent_q: dict[int, np.ndarray] = {}  # layer -> the query position in each recent slot (-1: none)
        self._before: tuple[np.ndarray, np.ndarray] | None = None  # counts before the step under way
        self._step = (0, 0)  # the query positions of the step under way

    # -- writing ---------------------------------------------------------------------------------------------
    def begin(self, q0: int, q1: int) -> None:
        """Rows ``q0 .. q1 - 1`` are about to land (every layer's): drop rows from ``q0`` on (a rewind), grow the
        bins so ``q1`` rows and keys fit."""
        if q0 < self.rows:
            self.truncate(q0)
        rows = q0 if q0 > self.rows else self.rows
        self.rows = rows
        while -(-q1 // self.rs) > self.row_bins:
            self._merge_rows()
        while -(-q1 // self.cs) > self.col_bins:
            self._merge_cols()
        self._grow(-(-q1 // self.rs), -(-q1 // self.cs))
        self._before = (self._count.copy(), self._rowcount.copy())
        self._step = (q0, q1)

    def add(self, layer: int, q0: int, probs: torch.Tensor, positions: np.ndarray | range | None = None,
            c0: int = 0) -> None:
        """Land ``probs`` ``(heads, rows, keys)`` (float32, any device) of query positions ``q0..``: key column
        ``j`` is position ``c0 + j``, or ``positions[j]`` when given (any order)."""
        probs = probs.detach().float()
        if positions is not None:
            positions = np.asarray(positions, dtype=np.int64)
            if positions.size and np.array_equal(positions, np.arange(positions[0], positions[0] + positions.size)):
                c0, positions = int(positions[0]), None
        if positions is not None:  # scattered: to logical order first
            width = int(positions.max()) + 1 if positions.size else 0
            logical = probs.new_zeros(*probs.shape[:2], width)
            logical[..., torch.as_tensor(positions, device=probs.device)] = probs
            probs, c0 = logical, 0
        rb0, cb0, mx, sm, rowsum = reduce_rows(probs, q0, c0, self.rs, self.cs)
        host = [t.cpu().numpy() for t in (mx, sm, rowsum)]
        self._land(layer, q0, probs, c0, rb0, cb0, *host)

    def end(self) -> None:
        """The step's rows have landed in every layer: count their cells."""
        q0, q1 = self._step
        nrb, ncb = self._count.shape
        self._count += causal_cells(q0, q1, self.rs, 0, nrb, self.cs, 0, ncb)
        np.add.at(self._rowcount, np.arange(q0, q1) // self.rs, 1)
        self.rows = max(self.rows, q1)
        self._before = None

    def _land(self, layer, q0, probs, c0, rb0, cb0, mx, sm, rowsum) -> None:
        H, C = rowsum.shape
        self._ensure_layer(layer, H)
        nrb, ncb = mx.shape[1], mx.shape[2]
        ncb = min(ncb, self._count.shape[1] - cb0)
        mx, sm = mx[:, :, :ncb], sm[:, :, :ncb]
        rows, cols = slice(rb0, rb0 + nrb), slice(cb0, cb0 + ncb)
        before = self._before[0][rows, cols]
        added = causal_cells(q0, q0 + C, self.rs, rb0, nrb, self.cs, cb0, ncb)
        old = self._mean[layer][:, rows, cols].astype(np.float32)
        total = before + added
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (np.nan_to_num(old) * before + sm) / total
        self._mean[layer][:, rows, cols] = np.where(total > 0, mean, np.nan)
        M = self._max[layer][:, rows, cols]
        self._max[layer][:, rows, cols] = np.where(added > 0, np.fmax(M, mx), M)
        share = 1.0 - rowsum  # (H, C): what the learned sinks took of each row
        b = (np.arange(q0, q0 + C) // self.rs)
        sink = self._sink[layer]
        np.maximum.at(sink[..., 0], (slice(None), b), share)
        np.add.at(sink[..., 1], (slice(None), b), share)
        self._keep_recent(layer, q0, probs, c0)

    def _keep_recent(self, layer: int, q0: int, probs: torch.Tensor, c0: int) -> None:
        C = probs.shape[1]
        first = max(q0, self._step[1] - self.recent) - q0
        if first >= C:
            return
        rows = probs[:, first:].cpu().numpy()  # (H, r, keys)
        width = c0 + rows.shape[2]
        buf = self._recent[layer]
        if width > buf.shape[2]:
            grown = np.zeros((*buf.shape[:2], max(width, 2 * buf.shape[2])), dtype=np.float32)
            grown[..., : buf.shape[2]] = buf
            buf = self._recent[layer] = grown
        for i in range(rows.shape[1]):
            q = q0 + first + i
            slot = q % self.recent
            buf[slot] = 0.0
            buf[slot, :, c0:width] = rows[:, i]
            self._recent_q[layer][slot] = q

    # -- reading ---------------------------------------------------------------------------------------------
    @property
    def layers(self) -> list[int]:
        return sorted(self._max)

    def has(self, layer: int) -> bool:
        return layer in self._max and self.rows > 0

    def row(self, layer: int, q: int) -> np.ndarray | None:
        """``(heads, q + 1)`` float32: query position ``q``'s attention over key positions ``0..q`` (0 where not
        read), or None when it is not among the recent rows held."""
        qs = self._recent_q.get(layer)
        if qs is None or q < 0 or qs[q % self.recent] != q:
            return None
        out = self._recent[layer][q % self.recent, :, : q + 1]
        return np.pad(out, ((0, 0), (0, q + 1 - out.shape[1]))) if out.shape[1] < q + 1 else out

    def holds(self, entry: tuple[int, int, int]) -> bool:
        """Whether the rows of a step's entry ``(layer, first query position, end)`` are all still held."""
        layer, q0, q1 = entry
        return q1 - q0 <= self.recent and all(self.row(layer, q) is not None for q in range(q0, q1))

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
        qs = self._recent_q.get(layer)
        return [] if qs is None else sorted(int(q) for q in qs if 0 <= q < self.rows)

    def overview(self, layer: int, head: int, rs: int, cs: int, r0: int, nr: int, c0: int, nc: int):
        """``(max, mean, cells)`` ``(nr, nc)`` of bins of sizes ``rs`` x ``cs`` (multiples of the stored ones)
        starting at row bin ``r0`` and key bin ``c0`` (in those sizes), up to the rows held; NaN where no cell."""
        fr, fc = rs // self.rs, cs // self.cs
        M = self._block(self._max[layer][head].astype(np.float32), r0 * fr, nr * fr, c0 * fc, nc * fc, np.nan)
        A = self._block(self._mean[layer][head].astype(np.float32), r0 * fr, nr * fr, c0 * fc, nc * fc, np.nan)
        N = self._block(self._count.astype(np.float64), r0 * fr, nr * fr, c0 * fc, nc * fc, 0.0)
        M = M.reshape(nr, fr, nc, fc)
        A, N = A.reshape(nr, fr, nc, fc), N.reshape(nr, fr, nc, fc)
        cells = N.sum((1, 3))
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = (np.nan_to_num(A) * N).sum((1, 3)) / cells
            mx = np.where(cells > 0, np.fmax.reduce(np.fmax.reduce(M, axis=3), axis=1), np.nan)
        return mx.astype(np.float32), np.where(cells > 0, mean, np.nan).astype(np.float32), cells

    def sink_share(self, layer: int, head: int, rs: int, r0: int, nr: int) -> tuple[np.ndarray, np.ndarray]:
        """Per row bin (size ``rs``, a multiple of the stored one, from bin ``r0``): the max and mean share of the
        learned sinks in its rows."""
        f = rs // self.rs
        s = self._block(self._sink[layer][head].T.copy(), 0, 2, r0 * f, nr * f, 0.0).reshape(2, nr, f)
        n = self._block(self._rowcount[None].astype(np.float64), 0, 1, r0 * f, nr * f, 0.0).reshape(nr, f).sum(1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return s[0].max(1), np.where(n > 0, s[1].sum(1) / n, np.nan)

    @staticmethod
    def _block(a: np.ndarray, r0: int, nr: int, c0: int, nc: int, fill: float) -> np.ndarray:
        out = np.full((nr, nc), fill, dtype=a.dtype)
        src = a[r0: r0 + nr, c0: c0 + nc]
        out[: src.shape[0], : src.shape[1]] = src
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held (overview, sinks, counts, recent rows)."""
        arrays = [*self._max.values(), *self._mean.values(), *self._sink.values(), *self._recent.values(),
                  *self._recent_q.values(), self._count, self._rowcount]
        return sum(a.nbytes for a in arrays)

    # -- bins ------------------------------------------------------------------------------------------------
    def _ensure_layer(self, layer: int, heads: int) -> None:
        if layer in self._max:
            return
        self.heads = max(self.heads, heads)
        nrb, ncb = self._count.shape
        self._max[layer] = np.full((heads, nrb, ncb), np.nan, dtype=np.float32)
        self._mean[layer] = np.full((heads, nrb, ncb), np.nan, dtype=np.float16)
        self._sink[layer] = np.zeros((heads, nrb, 2), dtype=np.float32)
        self._recent[layer] = np.zeros((self.recent, heads, 64), dtype=np.float32)
        self._recent_q[layer] = np.full(self.recent, -1, dtype=np.int64)

    def _grow(self, nrb: int, ncb: int) -> None:
        R, K = self._count.shape
        if nrb <= R and ncb <= K:
            return
        R2 = min(self.row_bins, max(nrb, 2 * R)) if nrb > R else R
        K2 = min(self.col_bins, max(ncb, 2 * K)) if ncb > K else K
        self._count = _padded(self._count, (R2, K2), 0)
        self._rowcount = _padded(self._rowcount, (R2,), 0)
        for d, fill in ((self._max, np.nan), (self._mean, np.nan)):
            for layer, a in d.items():
                d[layer] = _padded(a, (a.shape[0], R2, K2), fill)
        for layer, a in self._sink.items():
            self._sink[layer] = _padded(a, (a.shape[0], R2, 2), 0.0)

    def _merge_rows(self) -> None:
        self.rs *= 2
        for layer in self._max:
            self._max[layer], self._mean[layer] = _merged(self._max[layer], self._mean[layer], self._count, 1)
            s = _even(self._sink[layer], 1)
            self._sink[layer] = np.stack([np.maximum(s[:, 0::2, 0], s[:, 1::2, 0]),
                                          s[:, 0::2, 1] + s[:, 1::2, 1]], -1)
        c = _even(self._count, 0)
        self._count = c[0::2] + c[1::2]
        r = _even(self._rowcount, 0)
        self._rowcount = r[0::2] + r[1::2]

    def _merge_cols(self) -> None:
        self.cs *= 2
        for layer in self._max:
            self._max[layer], self._mean[layer] = _merged(self._max[layer], self._mean[layer], self._count, 2)
        c = _even(self._count, 1)
        self._count = c[:, 0::2] + c[:, 1::2]

    def truncate(self, n: int) -> None:
        """Keep rows ``0 .. n - 1`` only."""
        if n >= self.rows:
            return
        nrb, ncb = self._count.shape
        b = n // self.rs  # the bin that may keep some rows
        self._count[b:] = 0
        self._rowcount[b:] = 0
        for layer in self._max:
            self._max[layer][:, b:] = np.nan
            self._mean[layer][:, b:] = np.nan
            self._sink[layer][:, b:] = 0.0
            qs = self._recent_q[layer]
            qs[qs >= n] = -1
        kept = range(b * self.rs, n)
        self.rows = b * self.rs
        if kept and all(self.row(layer, q) is not None for layer in self._max for q in kept):
            self._step = (kept.start, n)
            self._before = (self._count.copy(), self._rowcount.copy())
            for layer in self._max:
                rows = np.stack([self._recent[layer][q % self.recent] for q in kept], 1)  # (H, rows, width)
                self._land_rows(layer, kept.start, torch.from_numpy(rows))
            self.end()

    def _land_rows(self, layer: int, q0: int, probs: torch.Tensor) -> None:
        rb0, cb0, mx, sm, rowsum = reduce_rows(probs, q0, 0, self.rs, self.cs)
        self._land(layer, q0, probs, 0, rb0, cb0, mx.numpy(), sm.numpy(), rowsum.numpy())


def _padded(a: np.ndarray, shape: tuple[int, ...], fill) -> np.ndarray:
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def _even(a: np.ndarray, axis: int, fill=0) -> np.ndarray:
    """``a`` padded along ``axis`` to an even length with ``fill`` (nothing there)."""
    if a.shape[axis] % 2 == 0:
        return a
    shape = list(a.shape)
    shape[axis] += 1
    return _padded(a, tuple(shape), fill)


def _merged(mx: np.ndarray, mean: np.ndarray, count: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """Neighbouring bins along ``axis`` (1: rows, 2: keys) of max and mean merged (the counts still unmerged)."""
    mx, mean = _even(mx, axis, np.nan), _even(mean, axis, np.nan)
    c = _even(count, axis - 1).astype(np.float32)[None]
    take = (lambda a, i: a[:, i::2]) if axis == 1 else (lambda a, i: a[:, :, i::2])
    m = np.fmax(take(mx, 0), take(mx, 1))
    c0, c1 = take(c, 0), take(c, 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = (np.nan_to_num(take(mean, 0).astype(np.float32)) * c0 + np.nan_to_num(take(mean, 1).astype(np.float32)) * c1)
        merged = np.where(c0 + c1 > 0, s / (c0 + c1), np.nan)
    return m, merged.astype(np.float16)
