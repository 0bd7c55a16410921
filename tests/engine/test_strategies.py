"""Every exact strategy behind one interface: same tokens and logits as recomputation, exact memory figures,
slot views, forks and rewinds."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvexplore
from kvexplore import CacheFullError, ConcatCache, Generator, NoCache, PreallocatedCache, kv_bytes, make_cache
from kvexplore.caches import FILLED, FREE, STALE
from helpers import no_cache_logits

EXACT = ["preallocated", "concat", "none", "paged", "sink"]  # sink: while the sequence fits its window
OPTIONS = {"paged": {"block_size": 4}}  # small pages: many page boundaries, and forks share a partial page


def reference_logits(model, tokens):
    """Logits of the last token, recomputed from scratch."""
    return no_cache_logits(model, tokens, last=True)


PROMPT = "Call me Ishmael. Some years ago"


def rewinds_and_forks(gen, steps=200):
    """200 steps with a rewind of 7 every 50 and a fork every 60: the step records and the forks."""
    gen.prefill(PROMPT)
    records, forks = [], []
    for step in range(steps):
        if step % 50 == 49:
            gen.rewind(7)
        if step % 60 == 30:
            forks.append(gen.fork())
        records.append(gen.step())
    return records, forks


@pytest.fixture(scope="module")
def recomputed(trained):
    """The same operations without a cache (everything recomputed at every step), run once for every strategy:
    each step's token and probability, the final tokens, and each fork's tokens after 5 more steps."""
    ref = Generator(trained, make_cache("none", trained))
    records, forks = rewinds_and_forks(ref)
    for fork in forks:
        fork.run(5, stop_at_eos=False)
    return [(r.token_id, r.prob) for r in records], ref.tokens, [fork.tokens for fork in forks]


@pytest.mark.long  # 200 steps against a recomputation
@pytest.mark.xdist_group("recomputed")  # one worker computes the shared reference once, not each worker
@pytest.mark.parametrize("kind", EXACT)
def test_200_steps_with_rewinds_and_forks_match_recomputation(trained, recomputed, kind):
    gen = Generator(trained, make_cache(kind, trained, max_seq_len=256, **OPTIONS.get(kind, {})))
    records, forks = rewinds_and_forks(gen)
    want_steps, want_tokens, want_forks = recomputed
    for a, (token_id, prob) in zip(records, want_steps, strict=True):
        assert a.token_id == token_id and abs(a.prob - prob) < 1e-5
    assert gen.tokens == want_tokens
    logits = trained(torch.tensor([gen.tokens[gen.cache.length:]]), gen.cache, gen.cache.length)[0, -1]
    # logits reach |15|: float32 sums in another order differ by about 1e-6 of that (1.05e-5 seen at 182 tokens)
    assert (logits - reference_logits(trained, gen.tokens)).abs().max() < 2e-5
    for fork, tokens in zip(forks, want_forks, strict=True):  # forks continue on their own and agree too
        fork.run(5, stop_at_eos=False)
        assert fork.tokens == tokens


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(EXACT), ops=st.lists(st.sampled_from(["step", "step", "rewind", "fork"]), max_size=25))
def test_random_operation_sequences_match_the_reference(tiny, kind, ops):
    gen = Generator(tiny, make_cache(kind, tiny, max_seq_len=64, **OPTIONS.get(kind, {})))
    gen.prefill([1, 5, 6, 7])
    for op in ops:
        if op == "step":
            gen.step()
        elif op == "rewind" and len(gen.history) > 1:
            gen.rewind(min(2, len(gen.history) - 1))
        elif op == "fork":
            twin = gen.fork()
            twin.run(2, stop_at_eos=False)
    ref = Generator(tiny, NoCache(tiny.config))
    ref.prefill([1, 5, 6, 7])
    ref.run(len(gen.history) - 1, stop_at_eos=False)
    assert gen.tokens == ref.tokens
    assert gen.cache.length == (0 if kind == "none" else len(gen.tokens) - 1)


def test_preallocated_memory_follows_the_formula(trained):
    c = trained.config
    cache = make_cache("preallocated", trained, max_seq_len=100, batch_size=2)
    trained(torch.tensor([[1, 5, 6, 7, 8]] * 2), cache, 0)
    r = cache.inspect.memory_report()
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4
    assert r.reserved_bytes == per_token * 2 * 100 and r.logical_bytes == r.analytic_bytes == per_token * 2 * 5
    assert (r.written_bytes, r.copied_bytes, r.allocations, r.frees) == (per_token * 2 * 5, 0, 0, 0)
    trained(torch.tensor([[9]] * 2), cache, 5)
    r = cache.inspect.memory_report()
    assert (r.length, r.written_bytes, r.copied_bytes, r.allocated_bytes) == (6, per_token * 2, 0, 0)


def test_concat_copies_the_whole_cache_every_step(trained):
    c = trained.config
    cache = make_cache("concat", trained)
    assert isinstance(cache, ConcatCache) and cache.inspect.reserved_bytes == 0
    trained(torch.tensor([[1, 5, 6, 7, 8]]), cache, 0)
    per_token = kv_bytes(c, 1)
    r = cache.inspect.memory_report()
    assert (r.written_bytes, r.copied_bytes, r.allocations, r.frees) == (5 * per_token, 0, 2 * c.num_layers, 0)
    ptr = cache.key(0).data_ptr()
    for pos in range(5, 9):
        before = cache.inspect.reserved_bytes
        trained(torch.tensor([[9]]), cache, pos)
        r = cache.inspect.memory_report()
        assert r.copied_bytes == before == pos * per_token  # the cache's size before the step
        assert r.written_bytes == per_token and r.allocated_bytes == (pos + 1) * per_token
        assert r.freed_bytes == before and r.allocations == r.frees == 2 * c.num_layers
        assert cache.key(0).data_ptr() != ptr  # a new storage every step
        ptr = cache.key(0).data_ptr()
    assert cache.inspect.reserved_bytes == r.logical_bytes == r.analytic_bytes == 9 * per_token
    layers = r.per_layer()  # measured per layer: one layer's K and V are 2 * kv_heads * head_dim * 4 bytes a position
    assert len(layers) == c.num_layers and {m.kind for m in layers} == {"full"}
    for m in layers:
        assert m.copied_bytes == 8 * 2 * c.num_kv_heads * c.head_dim * 4 and m.held == 9
        assert m.logical_bytes == m.reserved_bytes == m.analytic_bytes == 9 * per_token // c.num_layers
    cache.truncate(4)  # a rewind keeps the storage (a view) until the next write
    assert cache.length == 4 and cache.inspect.reserved_bytes == 9 * per_token and cache.key(0).shape[2] == 4
    assert cache.inspect.memory_report().logical_bytes == 4 * per_token


def test_slot_views(trained):
    cache = PreallocatedCache(trained.config, 10)
    trained(torch.tensor([[1, 5, 6, 7, 8, 9]]), cache, 0)
    cache.truncate(4)
    view = cache.inspect.slot_view()
    assert view.states == [FILLED] * 4 + [STALE] * 2 + [FREE] * 4
    assert view.positions == [0, 1, 2, 3] + [-1] * 6 and view.sharers == [1] * 4 + [0] * 6
    trained(torch.tensor([[10]]), cache, 4)
    assert cache.inspect.slot_view().states == [FILLED] * 5 + [STALE] + [FREE] * 4
    concat = ConcatCache(trained.config)
    trained(torch.tensor([[1, 5, 6]]), concat, 0)
    assert concat.inspect.slot_view().states == [FILLED] * 3 and concat.inspect.slot_view().positions == [0, 1, 2]
    assert NoCache(trained.config).inspect.slot_view().states == []


def test_generator_records_carry_memory(trained):
    gen = Generator(trained, make_cache("concat", trained))
    first = gen.prefill("Call me")
    second = gen.step()
    assert first.memory.length == first.cache_length and second.memory.copied_bytes == first.memory.reserved_bytes


def test_make_cache_errors_and_defaults(trained):
    cache = make_cache("preallocated", trained)
    assert cache.capacity == min(trained.config.max_position_embeddings, 2048) and cache.dtype == trained.dtype
    with pytest.raises(ValueError, match="unknown cache kind 'ring'; available: "
                                         "preallocated, concat, none, paged, quantized, sink"):
        make_cache("ring", trained)
    with pytest.raises(ValueError, match=r"cache kind 'concat' does not take \['bits'\]"):
        make_cache("concat", trained, bits=4)


def test_rewind_past_zero_and_full_cache_leave_caches_unchanged(trained):
    for cache in (PreallocatedCache(trained.config, 6), ConcatCache(trained.config)):
        trained(torch.tensor([[1, 5, 6]]), cache, 0)
        with pytest.raises(ValueError, match="cannot truncate to -1: the cache holds 3 positions"):
            cache.truncate(-1)
        assert cache.length == 3
    cache = PreallocatedCache(trained.config, 6)
    trained(torch.tensor([[1, 5, 6]]), cache, 0)
    report = cache.inspect.memory_report()
    with pytest.raises(CacheFullError):
        trained(torch.tensor([[7, 8, 9, 10]]), cache, 3)
    assert cache.length == 3 and cache.inspect.memory_report() == report


def test_fork_of_an_empty_cache_is_refused(trained):
    for kind in ("preallocated", "concat"):
        cache = make_cache(kind, trained, max_seq_len=8)
        with pytest.raises(ValueError, match=f"cannot fork an empty {type(cache).__name__}: there is no prefix"):
            cache.fork()
    assert isinstance(make_cache("none", trained).fork(), NoCache)
    with pytest.raises(RuntimeError, match=r"nothing to fork: call prefill\(prompt\) first"):
        Generator(trained, make_cache("concat", trained)).fork()


def test_make_cache_sizes_every_kind(trained):
    per_token = kv_bytes(trained.config, 1)
    sink = make_cache("sink", trained, max_seq_len=64)
    assert (sink.sinks, sink.window, sink.inspect.reserved_bytes) == (4, 60, 64 * per_token)
    assert make_cache("sink", trained, window=10, sinks=2).inspect.reserved_bytes == 12 * per_token
    assert make_cache("paged", trained, max_seq_len=64, block_size=16).inspect.reserved_bytes == 64 * per_token
    assert make_cache("quantized", trained, max_seq_len=1024, bits=4).inspect.reserved_bytes < 1024 * per_token / 3
    for kind in kvexplore.caches.STRATEGIES:  # every kind runs under the generator
        gen = Generator(trained, make_cache(kind, trained, max_seq_len=64))
        gen.prefill("Call me")
        assert len(gen.run(5, stop_at_eos=False)) == 5


@pytest.mark.parametrize("kind", [k for k in kvexplore.caches.STRATEGIES if k != "none"])
def test_batch_of_two_matches_single_sequences(trained, kind):
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11], [1, 12, 13, 14, 15, 16, 17, 18]])
    options = {"paged": {"block_size": 4}, "quantized": {"residual": 64}}.get(kind, {})
    cache = make_cache(kind, trained, max_seq_len=32, batch_size=2, **options)
    got = torch.cat([trained(ids[:, :5], cache, 0), *(trained(ids[:, i:i + 1], cache, i) for i in range(5, 8))], 1)
    for b in range(2):
        if kind == "evict":  # lossy: each sequence is pressed on its own, as it would be alone
            alone = make_cache(kind, trained, max_seq_len=32)
            want = torch.cat([trained(ids[b:b + 1, :5], alone, 0),
                              *(trained(ids[b:b + 1, i:i + 1], alone, i) for i in range(5, 8))], 1)[0]
            assert [alone.eviction.kept_positions(0)] == [cache.eviction.kept_positions(0, batch=b)]
        else:
            want = no_cache_logits(trained, ids[b:b + 1], batched=True)[0]
        assert (got[b] - want).abs().max() < 1e-4
