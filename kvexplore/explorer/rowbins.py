"""Attention rows reduced to aligned power-of-two bins as they are computed (the streaming side of
:mod:`kvexplore.views.bins`): :func:`reduce_rows` gives each bin of a block its max and sum, on the block's device;
:func:`causal_cells` counts the cells a bin holds (query ``q`` reads keys ``0..q``: a bin's mean is its sum over its
causal cells); :func:`merged` merges neighbouring bins in place.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def reduce_rows(p: torch.Tensor, q0: int, c0: int, rs: int, cs: int):
    """``p`` ``(heads, rows, keys)``: the probabilities of query positions ``q0..`` over key positions ``c0..``.

    Returns ``(first row bin, first column bin, max, sum, row sums)``: max and sum ``(heads, row bins, column
    bins)`` of the bins of sizes ``rs`` x ``cs`` the block touches (float32, on ``p``'s device; the block is padded
    with zeros to whole bins, which changes neither: probabilities are >= 0) and each row's sum ``(heads, rows)``."""
    H, C, W = p.shape
    fr, fc = q0 % rs, c0 % cs
    br, bc = (-(fr + C)) % rs, (-(fc + W)) % cs
    rowsum = p.sum(-1)
    if fr == 0 and br == 0 and rs > 1:  # whole row bins: reduce the rows first (cheap, contiguous), then keys
        R = C // rs
        m1, s1 = p.view(H, R, rs, W).amax(2), p.view(H, R, rs, W).sum(2)  # (H, R, W)
        if fc or bc:
            m1, s1 = F.pad(m1, (fc, bc)), F.pad(s1, (fc, bc))
        K = (fc + W + bc) // cs
        mx, sm = m1.view(H, R, K, cs).amax(-1), s1.view(H, R, K, cs).sum(-1)
        return q0 // rs, (c0 - fc) // cs, mx, sm, rowsum
    if fc:
        p = F.pad(p, (fc, bc))
    K = (fc + W + bc) // cs
    if bc and not fc:  # whole bins, then the last partial one apart (no copy of the block to pad it)
        whole = p[..., : W - W % cs].reshape(H, C, K - 1, cs)
        tail = p[..., W - W % cs:]
        s1 = torch.cat([whole.sum(-1), tail.sum(-1, keepdim=True)], -1)
        m1 = torch.cat([whole.amax(-1), tail.amax(-1, keepdim=True)], -1)
    else:
        by_col = p.view(H, C, K, cs)
        s1, m1 = by_col.sum(-1), by_col.amax(-1)  # (H, C, column bins), then the rows' bins (small)
    if fr + C <= rs:  # every row in one row bin (a decode step's row): reduce them as they are, no padded copy
        return (q0 - fr) // rs, (c0 - fc) // cs, m1.amax(1, keepdim=True), s1.sum(1, keepdim=True), rowsum
    if fr or br:
        s1, m1 = F.pad(s1, (0, 0, fr, br)), F.pad(m1, (0, 0, fr, br))
    R = (fr + C + br) // rs
    sm = s1.view(H, R, rs, K).sum(2)
    mx = m1.view(H, R, rs, K).amax(2)
    return (q0 - fr) // rs, (c0 - fc) // cs, mx, sm, rowsum


def causal_cells(q_lo: int, q_hi: int, rs: int, rb0: int, nrb: int, cs: int, cb0: int, ncb: int) -> np.ndarray:
    """``(nrb, ncb)`` int64: per bin (row bins ``rb0..`` of size ``rs``, column bins ``cb0..`` of size ``cs``) how
    many cells ``(q, k)`` with ``k <= q`` the rows ``q_lo .. q_hi - 1`` give it."""
    out = np.zeros((nrb, ncb), dtype=np.int64)
    if q_hi <= q_lo:
        return out
    q = np.arange(q_lo, q_hi, dtype=np.int64)
    starts = (cb0 + np.arange(ncb, dtype=np.int64)) * cs
    per_row = np.clip(q[:, None] - starts[None, :] + 1, 0, cs)  # (rows, ncb)
    rows_bin = q // rs - rb0
    keep = (rows_bin >= 0) & (rows_bin < nrb)
    rows_bin, per_row = rows_bin[keep], per_row[keep]
    if rows_bin.size:
        starts = np.flatnonzero(np.r_[True, rows_bin[1:] != rows_bin[:-1]])  # rows are in order
        out[rows_bin[starts]] += np.add.reduceat(per_row, starts, axis=0)
    return out


def padded(a: np.ndarray, shape: tuple[int, ...], fill) -> np.ndarray:
    """``a`` in a larger array; a fill of 0 is the system's zeroed pages, which cost nothing until written."""
    out = np.zeros(shape, dtype=a.dtype) if fill == 0 else np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


def even(a: np.ndarray, axis: int, fill=0) -> np.ndarray:
    """``a`` padded along ``axis`` to an even length with ``fill`` (nothing there)."""
    if a.shape[axis] % 2 == 0:
        return a
    shape = list(a.shape)
    shape[axis] += 1
    return padded(a, tuple(shape), fill)


def merged(mx: np.ndarray, mean: np.ndarray, count: np.ndarray, axis: int,
           max_dtype=None) -> tuple[np.ndarray, np.ndarray]:
    """Neighbouring bins along ``axis`` (2: rows, 3: keys) of max and mean ``(layers, heads, rows, keys)`` merged
    (``count`` ``(rows, keys)``: the cells per bin before merging), in place: the merged bins first along ``axis``,
    then empty ones (0), in the same arrays, so that nothing is allocated; the max in a new array only when
    ``max_dtype`` (default: as it was) differs. The mean is float16, each pair's weighted by its cells in float32.

    Layer by layer in torch, with temporaries of one layer: why and what it takes, docs/benchmarks.md ("The click
    that passes a power of two")."""
    n = mx.shape[axis]
    half, pairs = -(-n // 2), n // 2
    out = mx if max_dtype is None or np.dtype(max_dtype) == mx.dtype else np.zeros(mx.shape, dtype=max_dtype)
    M, A, O = torch.from_numpy(mx), torch.from_numpy(mean), torch.from_numpy(out)
    dim = axis - 1  # in one layer's (heads, rows, keys)

    def pair(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = t.narrow(dim, 0, 2 * pairs).unflatten(dim, (pairs, 2))
        return t.select(dim + 1, 0), t.select(dim + 1, 1)

    c0, c1 = pair(torch.from_numpy(count.astype(np.float32))[None])
    total = c0 + c1
    empty, divisor = total == 0, total.clamp(min=1)
    tail_empty = torch.from_numpy(count[None] == 0).select(dim, n - 1) if n % 2 else None
    for layer in range(mx.shape[0]):
        (m0, m1), (a0, a1) = pair(M[layer]), pair(A[layer])
        new_max = torch.maximum(m0, m1).to(O.dtype)
        new_mean = ((a0.float() * c0 + a1.float() * c1) / divisor).masked_fill_(empty, 0.0).half()
        if n % 2:  # the last bin has no neighbour: it stays as it is, moved to its merged place
            O[layer].select(dim, pairs).copy_(M[layer].select(dim, n - 1))
            A[layer].select(dim, pairs).copy_(A[layer].select(dim, n - 1)).masked_fill_(tail_empty, 0.0)
        O[layer].narrow(dim, 0, pairs).copy_(new_max)
        A[layer].narrow(dim, 0, pairs).copy_(new_mean)
        O[layer].narrow(dim, half, n - half).zero_()
        A[layer].narrow(dim, half, n - half).zero_()
    return out, mean
