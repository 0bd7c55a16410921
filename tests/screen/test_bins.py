"""Binning for the screen (kvexplore.views.bins): aligned power-of-two bins, max and mean, dominant class."""

import numpy as np
import pytest

from kvexplore.views import bins


def test_plan_is_full_resolution_when_it_fits_and_aligned_powers_of_two_beyond():
    b = bins.plan(0, 200, 256)
    assert (b.size, b.count, b.exact) == (1, 200, True)
    b = bins.plan(0, 4096, 256)
    assert (b.size, b.count) == (16, 256)
    b = bins.plan(100, 1000, 64)  # 900 wide: size 16, start aligned down to 96
    assert (b.start, b.size) == (96, 16) and b.count <= 64 and b.edges()[0] == 96
    assert b.label(0) == "positions 96–111 (16)" and bins.plan(0, 3, 8).label(2) == "position 2"
    grown = bins.plan(0, 4097, 256)  # one more position: the size doubles only when it must
    assert grown.size == 32 and bins.plan(0, 4000, 256).size == 16
    with pytest.raises(ValueError, match="max_bins"):
        bins.plan(0, 10, 0)


def test_reduce_max_and_mean_ignore_nan_and_match_a_loop():
    rng = np.random.default_rng(0)
    v = rng.random((3, 1000)).astype(np.float32)
    v[0, 5:9] = np.nan
    b = bins.plan(0, 1000, 100)
    got_max, got_mean = bins.reduce(v, b, "max"), bins.reduce(v, b, "mean")
    for i in range(b.count):
        lo, hi = b.edges()[i], b.last(i) + 1
        for r in range(3):
            seg = v[r, lo:hi][~np.isnan(v[r, lo:hi])]
            assert got_max[r, i] == pytest.approx(seg.max()) and got_mean[r, i] == pytest.approx(seg.mean(), rel=1e-5)
    assert np.isnan(bins.reduce(np.full((1, 8), np.nan), bins.plan(0, 8, 2), "mean")).all()
    np.testing.assert_array_equal(bins.reduce(v, bins.plan(0, 1000, 1000), "max"), v)
    with pytest.raises(ValueError, match="reduction"):
        bins.reduce(v, b, "median")


def test_dominant_picks_the_highest_priority_code_and_counts_it():
    codes = np.array([[0, 0, 2, 1, -1, -1, 1, 1]])
    priority = np.array([0, 5, 3])  # code 1 beats 2 beats 0
    best, counts = bins.dominant(codes, bins.plan(0, 8, 2), priority)
    assert best.tolist() == [[1, 1]] and counts.tolist() == [[1, 2]]


@pytest.mark.parametrize("axis", [2, 3])
@pytest.mark.parametrize("odd", [False, True])
def test_stored_bins_merge_pairwise_weighted_by_their_cells_in_place(axis, odd):
    """kvexplore.explorer.rowbins.merged (the attention store's halving of its resolution): the max of each pair, the
    mean weighted by each bin's cells (empty bins count for nothing, a pair of empty ones is 0), a last bin without
    a neighbour kept as it is; the merged bins first in the same arrays, empty ones (0) after them; the max in a new
    array of the dtype asked for, else in place."""
    from kvexplore.explorer.rowbins import merged

    rng = np.random.default_rng(1)
    shape = (5, 7) if odd else (6, 8)
    count = rng.integers(0, 5, size=shape)
    count[0, :2] = 0  # a pair of empty bins on either axis
    mx = rng.random((2, 3, *shape), dtype=np.float32) * (count > 0)
    mean = (rng.random((2, 3, *shape), dtype=np.float32) * (count > 0)).astype(np.float16)
    n = mx.shape[axis]
    take = (lambda a, j: a[:, :, j]) if axis == 2 else (lambda a, j: a[:, :, :, j])
    want = []
    for i in range(-(-n // 2)):
        pair = [j for j in (2 * i, 2 * i + 1) if j < n]
        cells = [count[j] if axis == 2 else count[:, j] for j in pair]
        total = np.sum(cells, axis=0)
        weighted = np.sum([take(mean, j).astype(np.float64) * c for j, c in zip(pair, cells)], axis=0)
        want.append((np.max([take(mx, j) for j in pair], axis=0),
                     np.divide(weighted, total, out=np.zeros_like(weighted), where=total > 0)))
    mean_in, mx_in = mean, mx.copy()
    got_max, got_mean = merged(mx, mean, count, axis, np.float16)
    assert got_max.dtype == np.float16 and got_mean.dtype == np.float16 and got_mean is mean_in
    assert got_max.shape == got_mean.shape == mx.shape
    for i, (want_max, want_mean) in enumerate(want):
        np.testing.assert_array_equal(take(got_max, i), want_max.astype(np.float16))
        np.testing.assert_allclose(take(got_mean, i).astype(np.float64), want_mean, rtol=1e-3, atol=1e-6)
    for i in range(len(want), n):
        assert not take(got_max, i).any() and not take(got_mean, i).any()
    same_max, _ = merged(mx_in, mean.copy(), count, axis)
    assert same_max is mx_in and same_max.dtype == np.float32
