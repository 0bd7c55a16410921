"""SnapKV's and H2O's scores against the field's reference (NVIDIA's kvpress, and the SnapKV authors' code):
SnapKV's defaults (average pooling, kernel 5, window 32) and its max pooling option on numbers worked out by hand,
H2O's ``normalize=True`` (kvpress's ObservedAttention: the sum divided by the queries that saw each key) by hand,
both on a small random model against kvpress's formulas applied to transformers' own attention weights, and the
errors bad options give. ``benchmarks/against_kvpress.py`` runs kvpress itself on SmolLM2."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kvexplore
from kvexplore.caches.presses import H2OPress, Observation, SnapKVPress, make_press
from kvexplore.errors import SettingsError

INF = math.inf


def observation(length: int, kv_heads: int, query_heads: int, window: int, attention=None, accumulated=None,
                n_kept: int = 4, order=None) -> Observation:
    """An observation of one sequence holding positions ``0 .. length - 1`` (in slot order ``order``), whose
    attention is ``attention`` ``(query_heads, window, length)`` given as it is (not computed from keys)."""
    order = torch.arange(length) if order is None else torch.tensor(order)
    obs = Observation(layer=0, keys=torch.zeros(1, kv_heads, length, 4), values=torch.zeros(1, kv_heads, length, 4),
                      valid=torch.ones(1, kv_heads, length, dtype=torch.bool),
                      positions=order.expand(1, kv_heads, length).clone(),
                      queries=torch.zeros(1, query_heads, window, 4),
                      query_positions=torch.arange(length - window, length),
                      accumulated=None if accumulated is None else torch.tensor([accumulated])[..., order],
                      scale=1.0, softcap=None, length=length, n_kept=n_kept)
    if attention is not None:
        given = torch.tensor([attention])[..., order]
        obs.attention = lambda last=None: given
    return obs


# Two query heads reading one KV head, a window of 2 queries over 8 positions (6 and 7 are the window's own keys).
# The window's summed votes for positions 0..5: head 0 [0.2, 0, 0.4, 0.1, 0, 0.3], head 1 [0, 0.5, 0, 0, 0.2, 0.1].
ATTENTION = [[[0.1, 0.0, 0.2, 0.1, 0.0, 0.1, 0.3, 0.2],
              [0.1, 0.0, 0.2, 0.0, 0.0, 0.2, 0.2, 0.3]],
             [[0.0, 0.25, 0.0, 0.0, 0.1, 0.05, 0.4, 0.2],
              [0.0, 0.25, 0.0, 0.0, 0.1, 0.05, 0.1, 0.5]]]
# Average pooling, kernel 5, two zeros of padding each side counted in the mean (the last keys before the window do
# not borrow the window's votes), e.g. position 0 of head 0: (0 + 0 + 0.2 + 0 + 0.4) / 5 = 0.12, of head 1:
# (0 + 0 + 0 + 0.5 + 0) / 5 = 0.10; summed over the group: 0.22.
AVG = [0.12 + 0.10, 0.14 + 0.10, 0.14 + 0.14, 0.16 + 0.16, 0.16 + 0.06, 0.08 + 0.06, INF, INF]
# Max pooling, kernel 5 (the padding never wins): head 0 [0.4, 0.4, 0.4, 0.4, 0.4, 0.3], head 1 [0.5] * 4 + [0.2] * 2.
MAX = [0.9, 0.9, 0.9, 0.9, 0.6, 0.5, INF, INF]


def test_snapkv_defaults_are_the_authors_and_kvpress():
    assert SnapKVPress().options() == dict(window=32, kernel=5, pooling="avg")
    assert make_press("snapkv").options() == dict(window=32, kernel=5, pooling="avg")
    assert SnapKVPress().queries == 32


def test_snapkv_averages_over_five_neighbours_by_default():
    scores = SnapKVPress(window=2).score(observation(8, 1, 2, 2, ATTENTION))
    assert torch.allclose(scores[0, 0], torch.tensor(AVG), atol=1e-6), scores


def test_snapkv_is_kvpress_formula_up_to_a_constant():
    """kvpress: the window's attention averaged over its queries, ``avg_pool1d(kernel, padding=kernel // 2,
    stride=1)`` over the keys before the window, averaged over the group: ours sums both, W * g times as large."""
    A = torch.tensor([ATTENTION])  # (1, nh, W, S)
    W, g = 2, 2
    theirs = F.avg_pool1d(A[..., :-W].mean(-2), kernel_size=5, padding=2, stride=1).view(1, 1, g, -1).mean(2)
    ours = SnapKVPress(window=W).score(observation(8, 1, 2, W, ATTENTION))
    assert torch.allclose(ours[0, 0, :-W], theirs[0, 0] * W * g, atol=1e-6)


def test_snapkv_max_pooling_stays_an_option():
    scores = SnapKVPress(window=2, pooling="max").score(observation(8, 1, 2, 2, ATTENTION))
    assert torch.allclose(scores[0, 0], torch.tensor(MAX), atol=1e-6), scores


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_pools_neighbouring_positions_whatever_the_slot_order(pooling):
    """A storage whose slots are not in position order (a press while decoding fills holes in place): the pooling
    runs over positions, and each slot gets its position's score."""
    order = [3, 0, 7, 5, 1, 6, 2, 4]
    scores = SnapKVPress(window=2, pooling=pooling).score(observation(8, 1, 2, 2, ATTENTION, order=order))
    want = torch.tensor(AVG if pooling == "avg" else MAX)[order]
    assert torch.allclose(scores[0, 0], want, atol=1e-6), scores


# H2O: one KV head, 6 positions, the attention each received summed over every query so far (and the group).
SUMS = [3.0, 1.0, 1.2, 0.9, 0.6, 0.5]


def test_h2o_by_default_sums_and_keeps_its_recent_share():
    assert H2OPress().options() == dict(recent_ratio=0.5, normalize=False)
    scores = H2OPress().score(observation(6, 1, 1, 1, accumulated=[SUMS], n_kept=4))
    assert scores[0, 0].tolist() == pytest.approx([3.0, 1.0, 1.2, 0.9, INF, INF])  # int(4 * 0.5) = 2 recent


def test_h2o_normalized_divides_by_the_queries_that_saw_each_key():
    """Position p of 6 was read by the queries at p .. 5: 6 - p of them (kvpress's ObservedAttention)."""
    scores = H2OPress(recent_ratio=0.0, normalize=True).score(observation(6, 1, 1, 1, accumulated=[SUMS]))
    want = [3.0 / 6, 1.0 / 5, 1.2 / 4, 0.9 / 3, 0.6 / 2, 0.5 / 1]
    assert scores[0, 0].tolist() == pytest.approx(want)
    # the plain sum keeps 0, 2, 1, 3; the mean keeps 0, 5, 2, 3 (4 ties 2 and 3 at 0.3: the cache keeps the earliest)
    assert sorted(scores[0, 0].topk(2).indices.tolist()) == [0, 5]
    mixed = H2OPress(recent_ratio=0.5, normalize=True).score(observation(6, 1, 1, 1, accumulated=[SUMS], n_kept=4))
    assert mixed[0, 0].tolist() == pytest.approx(want[:4] + [INF, INF])


def test_h2o_normalized_follows_positions_not_slots():
    order = [4, 1, 5, 0, 2, 3]
    scores = H2OPress(recent_ratio=0.0, normalize=True).score(
        observation(6, 1, 1, 1, accumulated=[SUMS], order=order))
    want = [SUMS[p] / (6 - p) for p in order]
    assert scores[0, 0].tolist() == pytest.approx(want)


# -- on a model: kvpress's formulas over transformers' own attention weights -----------------------------------

def reference_attentions(checkpoint, ids):
    """Every layer's attention ``(1, nh, T, T)`` from the transformers reference model (eager, then put back)."""
    _, ref = checkpoint("llama-gqa2")
    impl = ref.config._attn_implementation
    ref.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return ref(ids, output_attentions=True).attentions
    finally:
        ref.set_attn_implementation(impl)


def kvpress_kept(scores: torch.Tensor, n_kept: int) -> list[list[int]]:
    return [sorted(row.topk(n_kept).indices.tolist()) for row in scores[0]]


def test_snapkv_defaults_keep_what_kvpress_formula_keeps_on_a_model(tiny, checkpoint):
    ids = torch.randint(3, 250, (1, 80), generator=torch.Generator().manual_seed(3))
    T, W, H = 80, 32, tiny.config.num_kv_heads  # 40 kept: the window's 32 and 8 chosen before it
    g = tiny.config.num_heads // H
    cache = kvexplore.make_cache("evict", tiny, max_seq_len=96, press="snapkv", compression_ratio=0.5)
    tiny(ids, cache, 0)
    for layer, A in enumerate(reference_attentions(checkpoint, ids)):
        votes = A[..., -W:, :-W].mean(-2)  # kvpress's SnapKVPress.score, window_size=32
        theirs = F.avg_pool1d(votes, kernel_size=5, padding=2, stride=1).view(1, H, g, T - W).mean(2)
        ours, _ = cache.eviction.press_scores(layer)
        assert torch.allclose(ours[:, :-W], theirs[0] * W * g, rtol=1e-4, atol=1e-6)
        assert ours[:, -W:].isinf().all()
        theirs = F.pad(theirs, (0, W), value=theirs.max().item() + 1)
        assert cache.eviction.kept_positions(layer) == kvpress_kept(theirs, int(T * 0.5))


def test_h2o_normalized_keeps_what_observed_attention_keeps_on_a_model(tiny, checkpoint):
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(4))
    T, H = 40, tiny.config.num_kv_heads
    g = tiny.config.num_heads // H
    cache = kvexplore.make_cache("evict", tiny, max_seq_len=64, press="h2o", compression_ratio=0.5,
                                 press_options=dict(recent_ratio=0.0, normalize=True))
    tiny(ids, cache, 0)
    for layer, A in enumerate(reference_attentions(checkpoint, ids)):
        theirs = (A.sum(2) / torch.arange(T, 0, -1)).view(1, H, g, T).mean(2)  # kvpress's ObservedAttentionPress
        ours, _ = cache.eviction.press_scores(layer)
        assert torch.allclose(ours, theirs[0] * g, rtol=1e-4, atol=1e-6)
        assert cache.eviction.kept_positions(layer) == kvpress_kept(theirs, int(T * 0.5))


# -- bad options ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("press, options, message", [
    ("snapkv", dict(pooling="mean"), r"unknown pooling 'mean'; available: avg, max"),
    ("snapkv", dict(kernel=4), r"kernel must be odd so the pooling is centred on each key, got 4; use 5"),
    ("snapkv", dict(window=0), r"window must be at least 1, got 0"),
    ("snapkv", dict(kernel=2.5), r"kernel must be an integer, got 2.5 \(float\)"),
    ("h2o", dict(normalize="yes"), r"normalize must be True or False, got 'yes' \(str\); use normalize=True to "
                                   r"divide each key's attention by the queries that saw it"),
    ("h2o", dict(normalize=1), r"normalize must be True or False, got 1 \(int\)"),
    ("h2o", dict(recent_ratio=1.5), r"recent_ratio must be >= 0.0 and <= 1.0, got 1.5"),
    ("h2o", dict(normalise=True), r"press 'h2o' does not take \['normalise'\]"),
])
def test_bad_press_options_say_which_what_and_how_to_fix(tiny, press, options, message):
    with pytest.raises(SettingsError, match=message):
        kvexplore.make_cache("evict", tiny, max_seq_len=64, press=press, press_options=options)
