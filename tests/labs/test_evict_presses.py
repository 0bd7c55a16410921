"""What each press of the ``evict`` cache scores and keeps, against an independent reference
(tests/support/evict_reference.py, written from the papers): every press's scores and kept sets after the prompt and
while decoding, KNorm's budgets (ratio, tokens, pyramid) and head policies (per-head, shared, adaptive), ties broken
alike in both storages, decoding after eviction against a recomputation with the same kept set (both position modes,
both storages), and properties of what a press keeps."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evict_reference import Recorder, expected_rotations, recompute, run, simulate
from evict_support import OPTS, evict, tokens
from evict_support import models  # noqa: F401  (the fixture)
from kvexplore.caches.presses import TOVAPress
from helpers import no_cache_logits


def assert_scores_match(checks, heads: str = "per-head") -> None:
    """Each press's scores equal the reference at every held position (NaN elsewhere); the kept set is the
    budget's best (every kept score >= every evicted one, ties either way)."""
    assert checks
    for c in checks:
        H = c.got.shape[0]
        for h in range(H):
            want = c.want[h]
            held = torch.zeros(c.length, dtype=torch.bool)
            held[list(want)] = True
            assert c.got[h][~held].isnan().all(), (c.layer, c.length, h)
            w = torch.tensor([want[p] for p in sorted(want)], dtype=torch.float64)
            g = c.got[h][sorted(want)].double()
            assert torch.equal(w.isinf(), g.isinf()), (c.layer, c.length, h, w, g)
            fin = ~w.isinf()
            assert torch.allclose(g[fin], w[fin], rtol=1e-4, atol=1e-6), (c.layer, c.length, h, w, g)
            kept = c.kept[h]
            assert not (kept & ~held).any()
            if heads == "per-head":
                assert int(kept.sum()) == min(c.n_kept, len(want))
            ks, es = g[kept[sorted(want)]], g[~kept[sorted(want)]]
            if len(ks) and len(es):
                assert ks.min() >= es.max() - 1e-5, (c.layer, c.length, h)


# -- every press against the reference -------------------------------------------------------------------------------

PRESS_NAMES = ["knorm", "snapkv", "tova", "h2o", "streaming", "keydiff"]


@pytest.mark.parametrize("model_name", ["gqa2", "gqa8"])
@pytest.mark.parametrize("press", PRESS_NAMES + ["snapkv-avg"])
def test_prompt_press_scores_equal_the_reference(models, press, model_name):
    model = models(model_name)
    ids = tokens(24)
    name, opts = press.split("-")[0], OPTS.get(press)
    r = run(model, evict(model, press=name, press_options=opts, compression_ratio=0.6), ids, 20)
    checks = simulate(model, r, name, opts)
    assert [c.length for c in checks] == [20] * len(r.layers)  # one press, after the prompt
    assert all(c.n_kept == int(20 * (1 - 0.6)) for c in checks)
    assert_scores_match(checks)


@pytest.mark.parametrize("press", ["h2o", "snapkv"])
def test_a_long_prompts_attention_is_summed_in_chunks_of_rows_as_a_whole(models, press):
    """H2O sums the prompt's attention 256 query rows at a time; SnapKV's window reaches over the chunk border."""
    model = models("gqa2")
    ids = tokens(300, seed=24)
    opts = dict(window=48, kernel=5, pooling="max") if press == "snapkv" else None
    r = run(model, evict(model, press=press, press_options=opts, compression_ratio=0.7, max_seq_len=300), ids, 300)
    assert_scores_match(simulate(model, r, press, opts))


@pytest.mark.sampled
@pytest.mark.parametrize("model_name,positions,storage", [("gqa2", "keep", "compact"), ("mha", "rerotate", "mask"),
                                                          ("gqa8", "rerotate", "compact"), ("gptoss", "keep", "mask")])
@pytest.mark.parametrize("press", PRESS_NAMES)
def test_decoding_presses_score_what_is_held_as_the_reference(models, press, model_name, positions, storage):
    """Presses every 3 tokens while decoding, down to 6 positions per head, over keys held after earlier presses
    (re-rotated keys too: SnapKV, TOVA and H2O read them through attention)."""
    model = models(model_name)
    ids = tokens(30, seed=1)
    cache = evict(model, press=press, press_options=OPTS.get(press), compression_ratio=0.5, decode_every=3,
                  decode_target=6, positions=positions, storage=storage)
    r = run(model, cache, ids, 14)
    assert [(e.length, e.reason) for e in r.presses] == [(14, "prompt")] + [(n, "decode") for n in range(17, 31, 3)]
    assert [e.kept for e in r.presses] == [(7,) * len(r.layers)] + [(6,) * len(r.layers)] * 5  # int(14 * 0.5), target
    checks = simulate(model, r, press, OPTS.get(press), rerotate=positions == "rerotate")
    assert len(checks) == len(r.presses) * len(r.layers)
    assert_scores_match(checks)


class KNormThenTOVA(TOVAPress):
    """KNorm after the prompt (heads keep different positions), TOVA while decoding."""

    name = "knorm-then-tova"

    def score(self, obs):
        return -obs.keys.float().norm(dim=-1) if obs.length == 16 else super().score(obs)


@pytest.mark.parametrize("storage", ["compact", "mask"])
@pytest.mark.parametrize("press", ["tova", "snapkv", "h2o", "keydiff"])
def test_presses_while_decoding_score_each_heads_own_positions(models, press, storage):
    """Heads holding different positions (an adaptive budget, or TOVA after a KNorm prompt press): a later press
    scores each head's own positions (per position, whatever slot a compact head keeps it in)."""
    model = models("gqa2")
    ids = tokens(30, seed=2)
    first = KNormThenTOVA() if press == "tova" else press
    cache = evict(model, press=first, press_options=None if press == "tova" else OPTS.get(press),
                  compression_ratio=0.5, heads="per-head" if press == "tova" else "adaptive", decode_every=4,
                  decode_target=7, storage=storage)
    r = run(model, cache, ids, 16)
    assert r.kept[0][r.layers[0]][0] != r.kept[0][r.layers[0]][1]  # the heads do hold different positions
    checks = simulate(model, r, press, OPTS.get(press))
    assert_scores_match([c for c in checks if c.length > 16], heads="adaptive")


# -- decoding after eviction equals a recomputation with the same kept set -------------------------------------------

EXACT = [  # model, press, positions, storage, decode_every, heads
    ("gqa2", "knorm", "keep", "compact", None, "per-head"),
    ("gqa2", "knorm", "rerotate", "compact", None, "per-head"),
    ("gqa2", "snapkv", "keep", "mask", 3, "adaptive"),
    ("gqa2", "snapkv", "rerotate", "mask", 3, "adaptive"),
    ("gqa2", "h2o", "rerotate", "compact", 2, "adaptive"),
    ("gqa8", "tova", "keep", "compact", 1, "per-head"),
    ("gqa8", "keydiff", "rerotate", "mask", 4, "shared"),
    ("mha", "streaming", "rerotate", "compact", 3, "per-head"),
    ("gemma3", "knorm", "keep", "compact", 3, "per-head"),
    ("gemma3", "snapkv", "rerotate", "compact", 3, "adaptive"),
    ("gemma3", "h2o", "rerotate", "mask", 2, "per-head"),
    ("qwen3next", "knorm", "rerotate", "compact", 3, "adaptive"),
    ("qwen3next", "tova", "keep", "mask", 2, "per-head"),
    ("gptoss", "snapkv", "rerotate", "compact", 3, "per-head"),  # learned sinks, YaRN (the turn: no attention factor)
    ("gemma4", "knorm", "rerotate", "compact", 3, "adaptive"),  # shared layers read a pressed layer's cache
    ("gemma4", "h2o", "keep", "mask", 2, "per-head"),
    ("llama3", "keydiff", "rerotate", "compact", 2, "per-head"),  # Llama 3's scaled frequencies turn the keys
]


def assert_exact(model, cache, ids, prompt: int, chunks: list[int] | None = None) -> None:
    """Every logit of the run equals the recomputation with the same kept sets, and the rotations the cache
    reports are the rule's."""
    r = run(model, cache, ids, prompt, chunks)
    rotations = expected_rotations(r, cache.position_mode == "rerotate")
    for s in range(len(r.steps)):
        for l in r.layers:
            want = [[rot[p] for p in sorted(rot)] for rot in rotations[s][l]]
            assert r.rope[s][l] == want, (s, l)
    want = recompute(model, ids, r, rotations)
    assert (r.logits - want).abs().max() < 1e-4
    full = no_cache_logits(model, ids, batched=True)
    assert (r.logits[:, prompt:] - full[:, prompt:]).abs().max() > 1e-3  # the eviction matters
    return r


@pytest.mark.sampled
@pytest.mark.parametrize("model_name,press,positions,storage,every,heads", EXACT)
def test_decoding_after_eviction_equals_the_recomputation_with_the_same_kept_set(models, model_name, press, positions,
                                                                                 storage, every, heads):
    """Every logit of the run (prompt, then token by token with presses) equals one pass without a cache in which
    each pressed layer's KV head reads, for each query, what it held then: the kept keys at their own positions
    (keep) or turned to contiguous positions ending at the press's length (rerotate)."""
    model = models(model_name)
    ids = tokens(28, seed=3)
    cache = evict(model, press=press, press_options=OPTS.get(press), compression_ratio=0.6, positions=positions,
                  storage=storage, decode_every=every, heads=heads)
    r = assert_exact(model, cache, ids, 15)
    assert len(r.presses) == 1 + (0 if every is None else (28 - 15) // every)


@pytest.mark.parametrize("storage", ["compact", "mask"])
@pytest.mark.parametrize("positions", ["keep", "rerotate"])
def test_chunks_after_a_press_and_storage_that_grows_stay_exact(models, storage, positions):
    """Several tokens per step after a press (a mask per head and token), and a compacting storage that runs out of
    headroom and grows, with H2O's sums following the slots."""
    model = models("gqa2")
    ids = tokens(40, seed=16)
    cache = evict(model, press="h2o", compression_ratio=0.5, heads="adaptive", positions=positions, storage=storage,
                  decode_every=7, headroom=2)
    r = assert_exact(model, cache, ids, 14, chunks=[3, 1, 4, 2, 5, 1, 6, 4])
    assert [e.length for e in r.presses] == [14, 22, 29, 36]


# -- KNorm: the smallest key norms, budgets and head policies --------------------------------------------------------

def prompt_norms(model, ids) -> dict[int, torch.Tensor]:
    """Each full layer's key norms ``(kv_heads, positions)`` of the prompt, as the model computes them."""
    rec = Recorder()
    no_cache_logits(model, ids, tracer=rec, batched=True)
    return {l: rec.keys(l).norm(dim=-1) for l in rec.k}


def smallest(norms: torch.Tensor, n: int) -> list[list[int]]:
    return [sorted(norms[h].argsort()[:n].tolist()) for h in range(norms.shape[0])]


@pytest.mark.parametrize("budget", [dict(compression_ratio=0.25), dict(compression_ratio=0.5),
                                    dict(compression_ratio=0.9), dict(compression_ratio=0.0), dict(kept_tokens=5),
                                    dict(kept_tokens=40)])
def test_knorm_keeps_each_heads_smallest_key_norms(models, budget):
    model = models("gqa2")
    n = 21
    ids = tokens(n, seed=4)
    norms = prompt_norms(model, ids)
    cache = evict(model, **budget)
    model(ids, cache, 0)
    ratio = budget.get("compression_ratio")
    n_kept = min(n, budget["kept_tokens"]) if ratio is None else int(n * (1 - ratio))
    for l in cache.full_layers:
        assert cache.eviction.kept_positions(l) == smallest(norms[l], n_kept)
        assert cache.eviction.kept_mask(l).sum(-1).tolist() == [n_kept] * 2
    assert [e.kept for e in cache.eviction.press_events] == ([] if n_kept == n else [(n_kept, n_kept)])


def test_pyramid_schedule_gives_the_first_layer_the_most(zoo):
    """PyramidKV: budgets fall linearly from ``2m - m/beta`` to ``m/beta`` over the layers (mean ``m``)."""
    model = zoo.load("llama", heads=4, kv_heads=2, layers=4)
    n, beta = 40, 4.0
    ids = tokens(n, seed=5)
    norms = prompt_norms(model, ids)
    cache = evict(model, compression_ratio=0.5, schedule="pyramid", beta=beta)
    model(ids, cache, 0)
    m = int(n * 0.5)
    want = [round((2 * m - m / beta) - (2 * m - 2 * m / beta) * i / 3) for i in range(4)]
    assert want == [35, 25, 15, 5] and sum(want) == 4 * m
    assert cache.eviction.press_events[0].kept == tuple(want)
    for l, b in enumerate(want):
        assert cache.eviction.kept_positions(l) == smallest(norms[l], b)


def test_adaptive_heads_share_the_layers_budget_after_a_safeguard(models):
    """AdaKV: each head keeps its ``int(alpha * n_kept)`` best, the rest of the layer's ``n_kept * heads`` goes
    to the best remaining scores of any head: counts differ, the total does not."""
    model = models("mha")
    n, alpha = 24, 0.25
    ids = tokens(n, seed=6)
    norms = prompt_norms(model, ids)
    cache = evict(model, compression_ratio=0.5, heads="adaptive", alpha=alpha)
    model(ids, cache, 0)
    n_kept, H = 12, 4
    for l in cache.full_layers:
        score = -norms[l]
        guard = int(alpha * n_kept)
        keep = torch.zeros_like(score, dtype=torch.bool)
        for h in range(H):
            keep[h, score[h].argsort(descending=True)[:guard]] = True
        rest = score.masked_fill(keep, -math.inf).flatten().argsort(descending=True)[:n_kept * H - guard * H]
        keep.view(-1)[rest] = True
        want = [sorted(torch.nonzero(keep[h]).flatten().tolist()) for h in range(H)]
        got = cache.eviction.kept_positions(l)
        assert got == want
        assert sum(map(len, got)) == n_kept * H and len({len(g) for g in got}) > 1


def test_shared_heads_keep_the_same_positions_in_every_head(models):
    model = models("gqa2")
    ids = tokens(20, seed=7)
    norms = prompt_norms(model, ids)
    cache = evict(model, compression_ratio=0.5, heads="shared")
    model(ids, cache, 0)
    for l in cache.full_layers:
        want = sorted((-norms[l]).mean(0).argsort(descending=True)[:10].tolist())
        assert cache.eviction.kept_positions(l) == [want, want]


# -- ties and properties ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("press", ["snapkv", "streaming"])
def test_compact_and_mask_storages_keep_the_same_positions_through_exact_ties(models, press):
    """SnapKV's max pooling gives neighbours the same score, StreamingLLM's sinks are all inf: of equal scores the
    earliest is kept, in either storage, so both keep the same positions."""
    model = models("gqa2")
    ids = tokens(40, seed=25)
    opts = dict(window=4, kernel=5, pooling="max") if press == "snapkv" else dict(sinks=8)
    runs = [run(model, evict(model, press=press, press_options=opts, compression_ratio=0.75, heads=heads,
                             decode_every=3, storage=storage), ids, 20)
            for heads in ("per-head", "adaptive") for storage in ("compact", "mask")]
    assert runs[0].kept == runs[1].kept and runs[2].kept == runs[3].kept
    scores = [s for r in runs[:1] for step in r.scores for s in step.values()]
    finite = [x for s, _ in scores for x in s[~s.isnan() & ~s.isinf()].tolist()]
    assert len(set(finite)) < len(finite) or press == "streaming"  # there were ties to break
    assert press == "snapkv" or runs[0].kept[0][0] == [[0, 1, 2, 3, 4]] * 2  # 5 kept of 20: the first 5 sinks


@pytest.mark.long  # 25 examples of presses x storages
@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.integers(2, 30), ratio=st.sampled_from([0.0, 0.3, 0.5, 0.75, 0.95]),
       heads=st.sampled_from(["per-head", "shared", "adaptive"]), every=st.sampled_from([None, 1, 2, 5]),
       decode=st.integers(0, 8), positions=st.sampled_from(["keep", "rerotate"]),
       press=st.sampled_from(["knorm", "knorm", *PRESS_NAMES]))
def test_properties_of_what_a_press_keeps(models, prompt, ratio, heads, every, decode, positions, press):
    """After every step: each head holds at most its budget plus what was written since the last press, kept
    positions are sorted, unique and below the length, everything since the last press is held, the rotations are
    the rule's; a compacting and a masking storage keep the same positions (KNorm, positions kept: no near-ties)."""
    model = models("gqa2")
    every = every if ratio else None  # no budget, no target for a press while decoding (refused: test_evict_rewinds.py)
    ids = tokens(prompt + decode, seed=prompt * 31 + decode)
    runs = [run(model, evict(model, press=press, press_options=OPTS.get(press), compression_ratio=ratio,
                             heads=heads, decode_every=every, positions=positions, storage=storage), ids, prompt)
            for storage in ("compact", "mask")]
    H, n_kept = 2, max(1, int(prompt * (1 - ratio)))
    for r in runs:
        assert len(r.presses) == (prompt > n_kept) + (0 if every is None else decode // every)
        want = expected_rotations(r, positions == "rerotate")
        for s, (pos, n) in enumerate(r.steps):
            end = pos + n
            horizon = max([e.length for e in r.presses if e.length <= end], default=0)
            for l in r.layers:
                kept = r.kept[s][l]
                assert r.rope[s][l] == [[rot[p] for p in sorted(rot)] for rot in want[s][l]]
                for h in kept:
                    assert h == sorted(set(h)) and all(0 <= p < end for p in h)
                    assert set(range(horizon, end)) <= set(h)  # nothing written since the last press is gone
                if not horizon:  # no press yet: everything held
                    assert kept == [list(range(end))] * H
                elif heads == "adaptive":
                    assert sum(map(len, kept)) <= (n_kept + end - horizon) * H
                else:
                    assert all(len(h) <= n_kept + end - horizon for h in kept)
                if heads == "shared":
                    assert all(h == kept[0] for h in kept)
    if press == "knorm" and positions == "keep":
        assert runs[0].kept == runs[1].kept


def test_a_layer_whose_budget_holds_everything_still_shows_its_press(models):
    """A pyramid whose first layer's budget is the whole prompt: the press runs (an event for every layer) and the
    layer's scores are this press's, keeping everything, not an earlier press's or none."""
    model = models("gqa2")
    ids = tokens(20, seed=19)
    cache = evict(model, compression_ratio=0.25, schedule="pyramid", beta=4.0)
    r = run(model, cache, ids, 20)
    assert cache.eviction.press_events[0].kept == (20, 4)  # 2m - m/beta = 26.25, at most the 20 held; m/beta = 3.75
    assert cache.eviction.kept_positions(0) == [list(range(20))] * 2
    assert cache.eviction.press_scores(0) is not None and bool(cache.eviction.press_scores(0)[1].all())
    assert_scores_match(simulate(model, r, "knorm"), heads="adaptive")
