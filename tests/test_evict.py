"""The ``evict`` cache against an independent reference (tests/evict_reference.py, written from the papers): each
press's scores and kept sets, KNorm's budgets and head policies, the bytes it holds, decoding after eviction
against a recomputation with the same kept set (both position modes, both storages), and its refusals."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvexplore
from evict_reference import Recorder, expected_rotations, recompute, run, simulate
from kvexplore.caches.presses import TOVAPress
from kvexplore.errors import SettingsError
from zoo import VARIANTS
from helpers import no_cache_logits

MODELS = {"gqa2": ("llama", dict(heads=4, kv_heads=2)), "gqa8": ("qwen2", dict(heads=8, kv_heads=1, tied=True)),
          "mha": ("llama", dict(heads=4, kv_heads=4)), "gemma3": ("gemma3", dict(layers=3)),
          "qwen3next": ("qwen3_next", dict(layers=4)), "gptoss": ("gpt_oss", dict(layers=2)),
          "gemma4": ("gemma4", {}), "llama3": VARIANTS["llama3-rope-tied"]}
OPTS = {"snapkv": dict(window=4, kernel=3, pooling="max"), "streaming": dict(sinks=3), "h2o": dict(recent_ratio=0.25),
        "snapkv-avg": dict(window=5, kernel=5, pooling="avg")}


@pytest.fixture(scope="module")
def models(zoo):
    def get(name):
        arch, options = MODELS[name]
        return zoo.load(arch, **options)
    return get


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (1, n), generator=g)


def evict(model, **options):
    options.setdefault("max_seq_len", 64)
    return kvexplore.make_cache("evict", model, **options)


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


# -- 1. every press against the reference ------------------------------------------------------------------------

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


# -- 4. decoding after eviction equals a recomputation with the same kept set ----------------------------------------

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


# -- 2. KNorm: the smallest key norms, budgets and head policies ------------------------------------------------------

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
        assert cache.kept_positions(l) == smallest(norms[l], n_kept)
        assert cache.kept_mask(l).sum(-1).tolist() == [n_kept] * 2
    assert [e.kept for e in cache.press_events] == ([] if n_kept == n else [(n_kept, n_kept)])


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
    assert cache.press_events[0].kept == tuple(want)
    for l, b in enumerate(want):
        assert cache.kept_positions(l) == smallest(norms[l], b)


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
        got = cache.kept_positions(l)
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
        assert cache.kept_positions(l) == [want, want]


# -- 3. bytes ------------------------------------------------------------------------------------------------------

def test_compact_storage_holds_the_kept_positions_plus_the_stated_headroom(models):
    """Per pressed layer: reserved bytes = (kept positions over heads + overhead slots) x bytes per position and
    head, the overhead being ``headroom`` slots per head plus the padding of heads that keep fewer than the most;
    the memory report's used and analytic bytes = kept positions over heads x bytes per position and head."""
    model = models("mha")
    n, headroom = 30, 5
    ids = tokens(n + 3, seed=8)
    cache = evict(model, compression_ratio=0.5, heads="adaptive", headroom=headroom)
    before = evict(model, compression_ratio=0.0, headroom=headroom)
    model(ids[:, :n], before, 0)
    model(ids[:, :n], cache, 0)
    hd = model.config.head_dim
    per = 2 * hd * 4  # key + value, float32, one position of one head
    report = cache.memory_report()
    assert report.freed_bytes > 0
    for l in cache.full_layers:
        counts = [len(p) for p in cache.kept_positions(l)]
        assert sum(counts) == 4 * 15 and len(set(counts)) > 1
        k, v = cache.storage(l)
        assert k.shape[2] == v.shape[2] == max(counts) + headroom  # the storage really shrank ...
        assert before.storage(l)[0].shape[2] == n + headroom  # ... from what the unpressed prompt needs
        overhead = 4 * (max(counts) + headroom) - sum(counts)
        assert cache.overhead_slots(l) == overhead
        assert cache.layers[l].reserved_bytes() == (sum(counts) + overhead) * per
        mem = report.layers[l]
        assert mem.logical_bytes == mem.analytic_bytes == sum(counts) * per
    assert report.analytic_bytes == sum(len(p) for l in cache.full_layers for p in cache.kept_positions(l)) * per
    assert cache.reserved_bytes == sum(cache.layers[l].reserved_bytes() for l in cache.full_layers)
    slots = cache.storage(0)[0].shape[2]
    for p in range(n, n + 3):  # decoding writes in place while the headroom lasts
        model(ids[:, p:p + 1], cache, p)
        assert cache.storage(0)[0].shape[2] == slots
        assert cache.memory_report().allocations == 0


def test_mask_storage_keeps_every_slot_and_frees_nothing(models):
    model = models("gqa2")
    ids = tokens(20, seed=9)
    cache = evict(model, compression_ratio=0.5, storage="mask", max_seq_len=48)
    model(ids, cache, 0)
    per = 2 * model.config.head_dim * 4
    report = cache.memory_report()
    assert report.freed_bytes == 0
    for l in cache.full_layers:
        assert cache.storage(l)[0].shape[2] == 48
        assert cache.layers[l].reserved_bytes() == 48 * 2 * per
        assert cache.overhead_slots(l) == 2 * 48 - 2 * 10
        assert report.layers[l].logical_bytes == 2 * 10 * per  # what it attends to, not what it holds
    assert cache.reserved_bytes == 2 * 48 * 2 * per


# -- 5. refusals, rewinds, rollbacks and copies -------------------------------------------------------------------

@pytest.mark.parametrize("options,message", [
    (dict(press="foo"), r"unknown press 'foo'; available: knorm, snapkv, tova, h2o, streaming, keydiff"),
    (dict(compression_ratio=1.0), r"compression_ratio must be >= 0.0 and < 1 .* a ratio of 1 would keep nothing"),
    (dict(compression_ratio=-0.1), r"compression_ratio must be >= 0.0"),
    (dict(compression_ratio=None), r"give compression_ratio \(0 <= r < 1\) or kept_tokens"),
    (dict(kept_tokens=0), r"kept_tokens must be at least 1"),
    (dict(decode_target=3), r"decode_target .* give decode_every=N as well"),
    (dict(decode_every=0), r"decode_every must be at least 1"),
    (dict(press="snapkv", press_options=dict(windo=3)), r"press 'snapkv' does not take \['windo'\]"),
    (dict(press="snapkv", press_options=dict(kernel=4)), r"kernel must be odd .* use 5"),
    (dict(press=TOVAPress(), press_options=dict(window=2)), r"press options \['window'\] were given with a press obj"),
    (dict(positions="shift"), r"unknown positions 'shift'; available: keep, rerotate"),
    (dict(heads="all"), r"unknown heads 'all'; available: per-head, shared, adaptive"),
    (dict(schedule="flat"), r"unknown schedule 'flat'; available: uniform, pyramid"),
    (dict(storage="heap"), r"unknown storage 'heap'; available: compact, mask"),
])
def test_bad_options_are_refused_naming_the_fix(models, options, message):
    with pytest.raises(SettingsError, match=message):
        evict(models("gqa2"), **options)


def test_a_masking_storage_needs_max_seq_len_and_a_latent_model_is_refused(models):
    from helpers import architectures, no_cache_logits
    from kvexplore.config.model_config import ModelConfig

    with pytest.raises(SettingsError, match="storage='mask' allocates every position once: give max_seq_len"):
        kvexplore.EvictCache(models("gqa2").config, storage="mask")
    _, cls, example = architectures()["deepseek_v3"]
    latent = ModelConfig.from_hf(dict(architectures=[cls], model_type="deepseek_v3", vocab_size=300, hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=512, rms_norm_eps=1e-5, **example))
    with pytest.raises(SettingsError, match=r"layer 0 stores one compressed latent for every head \(MLA\); the evict "
                                            r"cache .* use another cache kind"):
        kvexplore.EvictCache(latent, max_seq_len=8)


def snapshot(cache, raw: bool = True) -> dict:
    """Everything a rewind, a rollback or a copy must leave as it was (``raw``: the storage's every slot too)."""
    out = dict(length=cache.length, events=cache.press_events, reserved=cache.reserved_bytes,
               report=cache.memory_report().analytic_bytes)
    for l in cache.full_layers:
        layer = cache.layers[l]
        k, v, valid, pos, rot = layer.held_slots()
        storage = [t.clone() if raw else t.shape for t in cache.storage(l)]
        out[l] = (cache.kept_positions(l), cache.rope_positions(l), storage,
                  k[valid].clone(), v[valid].clone(), cache.press_scores(l),
                  None if layer.acc is None else layer.acc.clone())
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, tuple):
            for u, w in zip(x, y):
                if isinstance(u, tuple):  # press scores (NaN where nothing was held)
                    assert torch.equal(u[0].nan_to_num(7.0), w[0].nan_to_num(7.0)) and torch.equal(u[1], w[1])
                elif isinstance(u, list) and u and isinstance(u[0], torch.Tensor):
                    assert all(torch.equal(s, t) for s, t in zip(u, w))
                elif isinstance(u, torch.Tensor):
                    assert torch.equal(u, w)
                else:
                    assert u == w, key
        else:
            assert x == y, key


@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_a_rewind_into_evicted_positions_is_refused_and_changes_nothing(models, storage):
    model = models("gqa2")
    ids = tokens(26, seed=10)
    cache = evict(model, press="h2o", storage=storage, decode_every=4, positions="rerotate")
    run(model, cache, ids, 16, chunks=[1] * 6)
    assert cache.pressplan.horizon == 20
    before = snapshot(cache)
    with pytest.raises(SettingsError, match=r"cannot truncate to 19: the press at length 20 evicted positions before "
                                            r"it; truncate to 20 or later"):
        cache.truncate(19)
    with pytest.raises(SettingsError, match=r"write at position 12 needs a rewind: cannot truncate to 12: the press at "
                                            r"length 20 evicted positions before it; truncate to 20 or later"):
        model(ids[:, 12:13], cache, 12)
    with pytest.raises(SettingsError, match=r"cannot truncate to 21: h2o sums the attention of every query so far, "
                                            r"those of positions 21..21 included, .* truncate to 22, or to 0"):
        cache.truncate(21)  # after the press, but the next press would read sums that hold position 21's query
    with pytest.raises(SettingsError, match=r"write at position 20 needs a rewind: cannot truncate to 20: h2o sums"):
        model(ids[:, 20:21], cache, 20)
    assert_same(snapshot(cache), before)
    cache.truncate(22)  # no rewind at all: fine


@pytest.mark.parametrize("storage", ["compact", "mask"])
@pytest.mark.parametrize("press", ["snapkv", "tova", "knorm"])
def test_decoding_after_a_truncate_equals_never_having_gone_further(models, storage, press):
    """Truncate back to the last press or later, decode other tokens: the same as a cache that never wrote the
    dropped ones (logits, when the next press runs, what it scores and keeps: SnapKV's window of queries too)."""
    model = models("gqa2")
    first, second = tokens(22, seed=11), tokens(26, seed=12)
    second[:, :17] = first[:, :17]
    options = dict(press=press, press_options=OPTS.get(press), storage=storage, decode_every=5, decode_target=8)
    cache = evict(model, **options)
    run(model, cache, first[:, :21], 16, chunks=[1, 1, 2])  # 16 .. 20, no decoding press yet (4 since the last)
    assert [e.length for e in cache.press_events] == [16]
    cache.truncate(17)
    got = torch.cat([model(second[:, p:p + 1], cache, p) for p in range(17, 26)], 1)
    fresh = evict(model, **options)
    run(model, fresh, second[:, :17], 16)
    want = torch.cat([model(second[:, p:p + 1], fresh, p) for p in range(17, 26)], 1)
    assert [e.length for e in cache.press_events] == [e.length for e in fresh.press_events] == [16, 21, 26]
    assert (got - want).abs().max() < 1e-5
    a, b = snapshot(cache), snapshot(fresh)
    for key in ("events", "length"):
        assert a[key] == b[key]
    for l in cache.full_layers:
        assert a[l][0] == b[l][0]  # kept positions
        assert torch.allclose(a[l][5][0].nan_to_num(7.0), b[l][5][0].nan_to_num(7.0), atol=1e-5)  # scores


@pytest.mark.parametrize("storage", ["compact", "mask"])
@pytest.mark.parametrize("positions", ["keep", "rerotate"])
def test_rolling_back_a_step_that_pressed_restores_the_cache_exactly(models, storage, positions):
    model = models("gqa2")
    ids = tokens(24, seed=13)
    cache = evict(model, press="h2o", storage=storage, positions=positions, decode_every=4, headroom=2)
    run(model, cache, ids[:, :19], 16)
    before = snapshot(cache)
    first = model(ids[:, 19:20], cache, 19, keep_undo=True)  # presses (4 since the last), and needs new storage
    assert len(cache.press_events) == 2
    cache.rollback()
    assert_same(snapshot(cache), before)
    again = model(ids[:, 19:20], cache, 19)
    assert torch.equal(first, again) and len(cache.press_events) == 2


@pytest.mark.parametrize("how", ["clone", "fork"])
@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_copies_are_independent(models, how, storage):
    model = models("gqa2")
    ids = tokens(30, seed=14)
    cache = evict(model, press="h2o", storage=storage, decode_every=3, positions="rerotate")
    run(model, cache, ids[:, :18], 16)
    twin = getattr(cache, how)()
    before = snapshot(twin)
    a = torch.cat([model(ids[:, p:p + 1], cache, p) for p in range(18, 30)], 1)  # four more presses
    assert len(cache.press_events) == 5
    assert_same(snapshot(twin), before)
    b = torch.cat([model(ids[:, p:p + 1], twin, p) for p in range(18, 30)], 1)
    assert torch.equal(a, b)
    assert_same(snapshot(twin), snapshot(cache))


def test_a_rewind_that_would_leave_snapkv_a_short_window_is_refused(models):
    """With presses to come while decoding, SnapKV keeps ``window + decode_every`` queries: a rewind within them is
    exact (above), one further back would leave the next press fewer queries than its window, and is refused."""
    model = models("gqa2")
    ids = tokens(16, seed=15)
    cache = evict(model, press="snapkv", press_options=dict(window=4), kept_tokens=20, decode_every=5)
    model(ids, cache, 0)
    assert cache.press_events == [] and cache.layers[0].query_pos.tolist() == list(range(7, 16))
    with pytest.raises(SettingsError, match=r"cannot truncate to 10: snapkv reads the last 4 queries and only 3 of "
                                            r"those before position 10 are kept; truncate to 11 or later"):
        cache.truncate(10)
    cache.truncate(11)
    assert cache.length == 11


@pytest.mark.parametrize("storage,press", [("compact", "snapkv"), ("mask", "snapkv"), ("compact", "tova"),
                                           ("compact", "h2o")])
def test_a_batch_of_two_is_pressed_as_each_sequence_alone(models, storage, press):
    """Adaptive budgets, re-rotation and presses while decoding: each sequence's kept sets, rotations and logits as
    if it ran alone (the rows of a compact storage hold different counts per head)."""
    model = models("gqa2")
    ids = torch.cat([tokens(24, seed=17), tokens(24, seed=18)])
    options = dict(press=press, press_options=OPTS.get(press), heads="adaptive", positions="rerotate",
                   storage=storage, decode_every=3, headroom=2)
    both = evict(model, batch_size=2, **options)
    got = torch.cat([model(ids[:, :14], both, 0), *(model(ids[:, p:p + 1], both, p) for p in range(14, 24))], 1)
    for b in range(2):
        alone = evict(model, **options)
        want = torch.cat([model(ids[b:b + 1, :14], alone, 0),
                          *(model(ids[b:b + 1, p:p + 1], alone, p) for p in range(14, 24))], 1)
        assert (got[b] - want[0]).abs().max() < 1e-4
        for l in alone.full_layers:
            assert both.kept_positions(l, batch=b) == alone.kept_positions(l)
            assert both.rope_positions(l, batch=b) == alone.rope_positions(l)
    assert both.kept_positions(0, batch=0) != both.kept_positions(0, batch=1)


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


@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_the_slot_views_show_each_layers_and_heads_own_kept_positions(models, storage):
    """What the cache map draws: every pressed layer's own slots (the layers keep different positions), each head's
    own, evicted slots shown as such in the masking storage."""
    model = models("gqa2")
    ids = tokens(20, seed=26)
    cache = evict(model, compression_ratio=0.5, storage=storage)
    model(ids, cache, 0)
    assert cache.kept_positions(0) != cache.kept_positions(1)
    views = cache.slot_views()
    for l in cache.full_layers:
        assert views[l] == cache.slot_view(l)  # head 0
        for h, kept in enumerate(cache.kept_positions(l)):
            view = cache.layers[l].slot_view(cache.length, head=h)
            assert sorted(p for p, st in zip(view.positions, view.states) if st == "filled") == kept
            evicted = view.states.count("evicted")
            assert evicted == (20 - len(kept) if storage == "mask" else 0)


class ReadRecorder(Recorder):
    """Also the keys each layer's attention read (the last pass's)."""

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[int, torch.Tensor] = {}

    def hook(self, name: str, t: torch.Tensor):
        if name.endswith("attn.cache_read"):
            self.read[int(name.split(".")[1])] = t[0].detach().clone()
        return super().hook(name, t)


@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_read_positions_name_the_key_in_every_column_attention_read(models, storage):
    """Per layer and head, the position in each key column the last step read (a press after the step moved the
    slots since): the column holds that position's key; -1 only where the head holds nothing."""
    model = models("gqa2")
    ids = tokens(24, seed=27)
    cache = evict(model, heads="adaptive", storage=storage, decode_every=2)
    rec = ReadRecorder()
    model(ids[:, :16], cache, 0, tracer=rec)
    for p in range(16, 24):
        model(ids[:, p:p + 1], cache, p, tracer=rec)
        assert len(cache.press_events) == 1 + (p - 15) // 2
        for l in cache.full_layers:
            by_head, read, keys = cache.read_positions_by_head(l), rec.read[l], rec.keys(l)
            assert cache.read_positions(l) == by_head[0] and all(len(h) == read.shape[1] for h in by_head)
            for h, positions in enumerate(by_head):
                held = [j for j, q in enumerate(positions) if q >= 0]
                assert torch.equal(read[h, held], keys[h, [positions[j] for j in held]])
                if storage == "compact":
                    assert held == list(range(len(held)))  # the padding after a head's own slots
                else:
                    assert positions == list(range(p + 1))
    reads = {cache.read_group(l) for l in cache.full_layers}
    assert len(reads) == len(cache.full_layers)  # each layer's own (a tracer keeps one list per group)


# -- 6. properties ----------------------------------------------------------------------------------------------------

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
    every = every if ratio else None  # no budget, no target for a press while decoding (refused, tested above)
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
    assert cache.press_events[0].kept == (20, 4)  # 2m - m/beta = 26.25, at most the 20 held; m/beta = 3.75
    assert cache.kept_positions(0) == [list(range(20))] * 2
    assert cache.press_scores(0) is not None and bool(cache.press_scores(0)[1].all())
    assert_scores_match(simulate(model, r, "knorm"), heads="adaptive")


@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_a_new_sequence_starts_the_presses_over(models, storage):
    """A truncate to 0 (the generator's reset) or a write at position 0 over a pressed cache is a new sequence:
    allowed, and then the same as a new cache (logits, presses, what they keep and score)."""
    model = models("gqa2")
    first, second = tokens(26, seed=20), tokens(24, seed=21)
    options = dict(press="h2o", storage=storage, decode_every=3, positions="rerotate")
    fresh = evict(model, **options)
    want = run(model, fresh, second, 13)
    for how in ("truncate", "write"):
        cache = evict(model, **options)
        run(model, cache, first, 18)
        if how == "truncate":
            cache.truncate(0)
            assert cache.length == 0 and cache.press_events == []
        got = run(model, cache, second, 13)
        assert (got.logits - want.logits).abs().max() < 1e-5
        assert got.presses == want.presses and got.kept == want.kept and got.rope == want.rope
        assert_same(snapshot(cache, raw=False), snapshot(fresh, raw=False))


def test_the_generator_resets_and_refuses_a_replay_the_presses_would_not_make(models):
    """A rewind that a sliding ring can only follow by recomputing the kept tokens is refused once a press ran (one
    prefill would press them as one prompt), changing nothing; a reset works."""
    model = models("gemma3")
    cache = evict(model, compression_ratio=0.5)
    gen = kvexplore.Generator(model, cache)
    gen.prefill(tokens(12, seed=22)[0].tolist())
    gen.run(4, stop_at_eos=False)
    before = snapshot(cache)
    with pytest.raises(SettingsError, match=r"cannot truncate to 14: the sliding-window layers \(window 8\) no longer "
                                            r"hold position 7.* \(recomputing the kept tokens instead would press "
                                            r"them as one prompt, not as the presses ran\)"):
        gen.rewind(2)
    assert_same(snapshot(cache), before)
    gen.rewind(1)  # the ring still holds what the kept sequence reads
    gen.reset()
    assert cache.length == 0 and cache.press_events == []
    gen.prefill(tokens(12, seed=22)[0].tolist())
    assert [e.length for e in cache.press_events] == [12]


class Failing(TOVAPress):
    """A press whose scoring fails at its second call (the second pressed layer of the first press)."""

    name = "failing"

    def __init__(self) -> None:
        self.calls = 0

    def score(self, obs):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("boom")
        return super().score(obs)


@pytest.mark.parametrize("storage", ["compact", "mask"])
def test_a_press_that_fails_leaves_the_cache_as_before_the_step(models, storage):
    """A press is the cache's own step (a custom press may raise): when it fails half-way through the layers, the
    step is undone as a failed forward pass is, and the cache goes on as if it never ran."""
    model = models("gqa2")
    ids = tokens(20, seed=23)
    cache = evict(model, press=Failing(), storage=storage)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="boom"):
        model(ids[:, :12], cache, 0)  # the prompt's press: layer 0 scores, layer 1 fails
    assert_same(snapshot(cache), before)
    got = model(ids[:, :12], cache, 0)  # the third and fourth calls succeed
    want = model(ids[:, :12], evict(model, press="tova"), 0)
    assert torch.equal(got, want) and len(cache.press_events) == 1


def test_a_press_while_decoding_fills_the_evicted_slots_in_place_and_rolls_back_exactly(trained):
    """A press while decoding on storage already of its size moves only the kept slots past the new count into the
    evicted ones (no new storage, a few slots copied); a rollback of that step puts every slot back."""
    c = evict(trained, press="h2o", compression_ratio=0.5, decode_every=4)  # evicts old slots, not only new ones
    ids = tokens(30)
    trained(ids[:, :20], c, 0)
    for p in range(20, 23):
        trained(ids[:, p:p + 1], c, p)
    layer = c.layers[0]
    before, storage = c.clone(), layer.k.data_ptr()
    logits = trained(ids[:, 23:24], c, 23, keep_undo=True)  # the fourth token: a press back to 10 per head
    assert [e.reason for e in c.press_events][-1] == "decode" and layer.k.data_ptr() == storage
    assert all(len(h) == 10 for h in c.kept_positions(0))
    per_slot = 2 * trained.config.head_dim * 4
    assert 0 < c.memory_report().copied_bytes <= 4 * trained.config.num_kv_heads * per_slot * trained.config.num_layers
    assert c.memory_report().allocated_bytes == 0
    c.rollback()
    for i in c.full_layers:
        assert c.kept_positions(i) == before.kept_positions(i)
        got, want = c.layers[i].held_slots(), before.layers[i].held_slots()
        for g, w in zip(got, want):
            assert torch.equal(g, w)
    again = trained(ids[:, 23:24], c, 23)
    assert torch.equal(again, logits)
