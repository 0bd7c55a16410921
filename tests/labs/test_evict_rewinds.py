"""The ``evict`` cache's refusals and what must leave it as it was: bad options refused naming the fix, rewinds into
evicted positions (or that a press's state no longer covers) refused changing nothing, decoding after a truncate,
rollbacks, copies, a new sequence, the generator's reset, and a press that fails half-way through the layers."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from evict_reference import run
from evict_support import OPTS, evict, tokens
from evict_support import models  # noqa: F401  (the fixture)
from kvexplore.caches.presses import TOVAPress
from kvexplore.errors import SettingsError


# -- refusals --------------------------------------------------------------------------------------------------------

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
    from helpers import architectures
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


# -- rewinds, rollbacks and copies -----------------------------------------------------------------------------------

def snapshot(cache, raw: bool = True) -> dict:
    """Everything a rewind, a rollback or a copy must leave as it was (``raw``: the storage's every slot too)."""
    out = dict(length=cache.length, events=cache.eviction.press_events, reserved=cache.inspect.reserved_bytes,
               report=cache.inspect.memory_report().analytic_bytes)
    for l in cache.full_layers:
        layer = cache.layers[l]
        k, v, valid, pos, rot = layer.held_slots()
        storage = [t.clone() if raw else t.shape for t in cache.inspect.storage(l)]
        out[l] = (cache.eviction.kept_positions(l), cache.eviction.rope_positions(l), storage,
                  k[valid].clone(), v[valid].clone(), cache.eviction.press_scores(l),
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
    assert [e.length for e in cache.eviction.press_events] == [16]
    cache.truncate(17)
    got = torch.cat([model(second[:, p:p + 1], cache, p) for p in range(17, 26)], 1)
    fresh = evict(model, **options)
    run(model, fresh, second[:, :17], 16)
    want = torch.cat([model(second[:, p:p + 1], fresh, p) for p in range(17, 26)], 1)
    lengths = [e.length for e in cache.eviction.press_events]
    assert lengths == [e.length for e in fresh.eviction.press_events] == [16, 21, 26]
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
    assert len(cache.eviction.press_events) == 2
    cache.rollback()
    assert_same(snapshot(cache), before)
    again = model(ids[:, 19:20], cache, 19)
    assert torch.equal(first, again) and len(cache.eviction.press_events) == 2


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
    assert len(cache.eviction.press_events) == 5
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
    assert cache.eviction.press_events == [] and cache.layers[0].query_pos.tolist() == list(range(7, 16))
    with pytest.raises(SettingsError, match=r"cannot truncate to 10: snapkv reads the last 4 queries and only 3 of "
                                            r"those before position 10 are kept; truncate to 11 or later"):
        cache.truncate(10)
    cache.truncate(11)
    assert cache.length == 11


# -- new sequences and failures --------------------------------------------------------------------------------------

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
            assert cache.length == 0 and cache.eviction.press_events == []
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
    assert cache.length == 0 and cache.eviction.press_events == []
    gen.prefill(tokens(12, seed=22)[0].tolist())
    assert [e.length for e in cache.eviction.press_events] == [12]


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
    assert torch.equal(got, want) and len(cache.eviction.press_events) == 1
