"""SinkCache: exact while the sequence fits; after that, flat memory, exact evictions, and attention equal to a
recomputation that lets each query read only the sinks and the last ``window`` positions (original positions)."""

import dataclasses

import pytest
import torch

import kvexplore
from helpers import FailingTracer, no_cache_logits
from kvexplore import Generator, PreallocatedCache, kv_bytes
from kvexplore.caches import FILLED, FREE, STALE, RingLayout
from kvexplore.caches.strategies.sink import SinkCache


@pytest.fixture(params=["tiny", "trained"])
def model(request):
    return request.getfixturevalue(request.param)


def tok(p):
    """A deterministic token for position p (valid in every test vocabulary)."""
    return 3 + (p * 37) % 250


def streaming_reference(model, tokens, sinks, lo):
    """Logits of every position recomputed from scratch, query q reading keys j <= q with j < sinks or j >= lo[q]
    (at their original positions): what a sink cache must produce."""
    j = torch.arange(len(tokens))[None, :]
    allowed = (j < sinks) | (j >= torch.tensor(lo)[:, None])

    class Mask:
        def hook(self, name, t):
            if name.endswith("attn.scores"):
                return t.masked_fill(~allowed, float("-inf"))

        def wants_attention(self, layer):
            return True

    return no_cache_logits(model, tokens, tracer=Mask())


def decode(model, cache, tokens, start):
    """Feed tokens[start:] one at a time (tokens[:start] already cached); the last logits of each step."""
    return [model(torch.tensor([[tokens[p]]]), cache, p)[0, -1] for p in range(start, len(tokens))]


def tolerance(model):
    """Float32 rounding of recomputation vs cached decoding: the trained model's logits (|x| ~ 10) differ by up to
    1.2e-5 with the PreallocatedCache too on these sequences; the random test model's stay within 1e-5 where both
    take F.linear, 1.1e-5 where decoding's one-row products take the compiled kernel (kvexplore.fast.kernels)."""
    return 2e-5


def test_while_it_fits_logits_equal_recomputation(model):
    cache, pre = SinkCache(model.config, window=12, sinks=4), PreallocatedCache(model.config, 16)
    tokens = [tok(p) for p in range(16)]
    got = {}
    for c in (cache, pre):
        got[c] = [model(torch.tensor([tokens[:5]]), c, 0)[0, -1], model(torch.tensor([tokens[5:8]]), c, 5)[0, -1]]
        got[c] += decode(model, c, tokens, 8)
    for end, logits, same in zip([5, 8, *range(9, 17)], got[cache], got[pre]):
        ref = no_cache_logits(model, tokens[:end], last=True)
        assert (logits - ref).abs().max() < tolerance(model) and torch.equal(logits, same)  # bit for bit
    assert cache.length == cache.inspect.held == 16 and len(cache.evicted_positions) == 0
    assert cache.evicted_last_step == []
    assert cache.inspect.used_bytes == cache.inspect.reserved_bytes == kv_bytes(model.config, 16)
    view = cache.inspect.slot_view()
    assert view.states == [FILLED] * 16 and view.positions == list(range(16))


def test_greedy_tokens_equal_the_preallocated_cache_while_it_fits(trained):
    a = Generator(trained, SinkCache(trained.config, window=80, sinks=4))
    b = Generator(trained, PreallocatedCache(trained.config, 84))
    for g in (a, b):
        g.prefill("Call me Ishmael. Some years ago")
        g.run(60, stop_at_eos=False)
    assert a.tokens == b.tokens and len(a.tokens) <= 84
    assert all(abs(x.prob - y.prob) < 1e-5 for x, y in zip(a.history, b.history))


def test_overflow_keeps_memory_flat_and_reports_each_eviction(tiny):
    S, W = 4, 8
    cache = SinkCache(tiny.config, window=W, sinks=S)
    reserved, ptrs = cache.inspect.reserved_bytes, [cache.key(i).data_ptr() for i in range(tiny.config.num_layers)]
    assert reserved == kv_bytes(tiny.config, S + W) and cache.capacity is None
    tiny(torch.tensor([[tok(p) for p in range(6)]]), cache, 0)
    for p in range(6, 400):
        tiny(torch.tensor([[tok(p)]]), cache, p)
        assert cache.length == p + 1
        assert cache.evicted_last_step == ([p - W] if p >= S + W else [])
        assert list(cache.evicted_positions) == list(range(S, max(S, p + 1 - W)))
        assert sorted(cache.slots.held_positions(cache.length)) == [*range(S), *range(max(S, p + 1 - W), p + 1)]
        report = cache.inspect.memory_report()
        assert report.reserved_bytes == cache.inspect.reserved_bytes == reserved
        assert report.written_bytes == kv_bytes(tiny.config, 1)
        assert report.copied_bytes == report.allocated_bytes == report.allocations == 0
        assert report.logical_bytes == cache.inspect.used_bytes == kv_bytes(tiny.config, min(p + 1, S + W))
    assert [cache.key(i).data_ptr() for i in range(tiny.config.num_layers)] == ptrs  # never reallocated
    view = cache.inspect.slot_view()
    ring = [399 - (399 - S - i) % W for i in range(W)]  # slot S + (p - S) % W holds position p
    assert view.states == [FILLED] * (S + W) and view.positions == [0, 1, 2, 3, *ring]
    assert view.layout == RingLayout(sinks=S, window=W, ring_start=S + (400 - W - S) % W,
                                     write_slot=S + (400 - S) % W, evicted=400 - W - S)
    assert cache.slots.held_positions(cache.length) == view.positions  # keys are read in storage order
    assert cache.inspect.held_positions_of(0) == sorted(view.positions)  # the layer's own answer, oldest first


def test_attention_after_overflow_equals_the_sink_reference(model):
    S, W = 4, 8
    cache = SinkCache(model.config, window=W, sinks=S)
    tokens = [tok(p) for p in range(40)]
    seen = {}

    class Spy:  # what attention reads through the cache interface
        def __getattr__(self, name):
            return getattr(cache, name)

        def write(self, layer, pos, k, v, queries=None):
            seen[layer] = cache.write(layer, pos, k, v, queries)
            return seen[layer]

    model(torch.tensor([tokens[:5]]), cache, 0)
    got = decode(model, Spy(), tokens, 5)
    ref = streaming_reference(model, tokens, S, [max(S, q - W + 1) for q in range(40)])
    full = no_cache_logits(model, tokens)
    for q, logits in zip(range(5, 40), got):
        assert (logits - ref[q]).abs().max() < tolerance(model), q
    assert (got[-1] - full[-1]).abs().max() > 1e-3  # the eviction matters: the reference is not trivially met
    # keys keep their original rotation: layer 0's are those of a full cache at the held positions
    pre = PreallocatedCache(model.config, 40)
    model(torch.tensor([tokens]), pre, 0)
    k0, v0 = seen[0]
    assert k0.shape[2] == S + W and k0.data_ptr() == cache.key(0).data_ptr()  # a view, not a gather
    held = cache.slots.held_positions(cache.length)
    assert torch.allclose(k0, pre.key(0)[:, :, held], atol=1e-5) and torch.allclose(v0, pre.value(0)[:, :, held],
                                                                                    atol=1e-5)


@pytest.mark.parametrize("sinks, window", [(0, 5), (1, 1), (3, 2)])
def test_batched_overflow_with_few_or_no_sinks(tiny, sinks, window):
    cache = SinkCache(tiny.config, window=window, sinks=sinks, batch_size=2)
    seqs = [[tok(p) for p in range(24)], [tok(p + 7) for p in range(24)]]
    n = min(3, sinks + window)
    tiny(torch.tensor([s[:n] for s in seqs]), cache, 0)
    got = [tiny(torch.tensor([[s[p]] for s in seqs]), cache, p)[:, -1] for p in range(n, 24)]
    for b in range(2):
        ref = streaming_reference(tiny, seqs[b], sinks, [max(sinks, q - window + 1) for q in range(24)])
        assert all((g[b] - ref[q]).abs().max() < tolerance(tiny) for q, g in zip(range(n, 24), got))
    assert len(cache.evicted_positions) == 24 - window - sinks and cache.inspect.held == sinks + window


def test_errors_are_clear_and_leave_the_cache_unchanged(tiny):
    with pytest.raises(ValueError, match="window must be at least 1, got 0"):
        SinkCache(tiny.config, window=0)
    with pytest.raises(ValueError, match="sinks must be at least 0, got -1"):
        SinkCache(tiny.config, window=4, sinks=-1)
    cache = SinkCache(tiny.config, window=8, sinks=4)
    tiny(torch.tensor([[tok(p) for p in range(10)]]), cache, 0)
    decode(tiny, cache, [tok(p) for p in range(30)], 10)
    state = lambda: (cache.length, list(cache.evicted_positions), cache.inspect.slot_view(),  # noqa: E731
                     [cache.key(i).clone() for i in range(tiny.config.num_layers)])
    before = state()
    with pytest.raises(ValueError, match=r"cannot rewind to 10: positions 4..21 were evicted \(the window starts at "
                                         r"position 22\); rewind to 22 or later, or to 4 or earlier"):
        cache.truncate(10)
    with pytest.raises(ValueError, match="write at position 15 needs a rewind: cannot rewind to 15"):
        tiny(torch.tensor([[5]]), cache, 15)
    after = state()
    assert after[:3] == before[:3] and all(torch.equal(a, b) for a, b in zip(after[3], before[3]))


@pytest.mark.parametrize("sinks, window, chunks", [(4, 8, [13, 3, 5, 1, 9]), (0, 5, [2, 7, 6]), (2, 3, [1, 4, 4, 2]),
                                                   (3, 6, [20])])
def test_writes_of_several_tokens_that_evict_equal_the_streaming_reference(tiny, sinks, window, chunks):
    """A prompt longer than the window, and chunks (speculative drafts) that wrap the ring or evict: every query reads
    the sinks and its own last ``window`` positions, as one token at a time would; the stored slots are the same."""
    cache, one = SinkCache(tiny.config, window=window, sinks=sinks), SinkCache(tiny.config, window=window, sinks=sinks)
    tokens, pos, got = [tok(p) for p in range(sum(chunks))], 0, []
    for n in chunks:
        got.extend(tiny(torch.tensor([tokens[pos:pos + n]]), cache, pos)[0])
        pos += n
    decode(tiny, one, tokens, 0)
    ref = streaming_reference(tiny, tokens, sinks, [max(sinks, q - window + 1) for q in range(len(tokens))])
    assert max(float((g - r).abs().max()) for g, r in zip(got, ref)) < tolerance(tiny)
    assert cache.slots.held_positions(cache.length) == one.slots.held_positions(one.length)
    assert cache.inspect.slot_view() == one.inspect.slot_view()
    assert len(cache.evicted_positions) == len(one.evicted_positions) == max(0, len(tokens) - window - sinks)
    for i in range(tiny.config.num_layers):
        assert torch.allclose(cache.key(i), one.key(i), atol=1e-5) and torch.allclose(cache.value(i), one.value(i),
                                                                                      atol=1e-5)


def test_position_limit_and_sliding_window_models(tiny):
    cache = SinkCache(tiny.config, window=4, sinks=2, max_seq_len=10)
    tiny(torch.tensor([[tok(p) for p in range(6)]]), cache, 0)
    decode(tiny, cache, [tok(p) for p in range(10)], 6)
    with pytest.raises(kvexplore.CacheFullError, match="cache full: 10 of 10"):
        tiny(torch.tensor([[5]]), cache, 10)
    # a model whose layers all slide (Mistral): every layer gets a ring of the model's window, so the sinks serve
    # no layer; the cache says so and decodes exactly like the pre-allocated cache past the window
    mistral = kvexplore.load("tiny")
    mistral.config = dataclasses.replace(mistral.config, sliding_window=6, layer_types=[])
    cache, ref = SinkCache(mistral.config, window=4, sinks=2), PreallocatedCache(mistral.config, 32)
    assert cache.full_layers == [] and "sliding layers: a ring of 6 slots" in cache.inspect.describe_layers()
    tokens = [tok(p) for p in range(20)]
    got, want = decode(mistral, cache, tokens, 0), decode(mistral, ref, tokens, 0)
    assert (torch.equal(torch.stack(got), torch.stack(want))
            and cache.inspect.reserved_bytes == ref.inspect.reserved_bytes == kv_bytes(mistral.config, 6))


def test_rewind_into_the_window_then_to_the_sinks(tiny):
    S, W = 4, 8
    cache = SinkCache(tiny.config, window=W, sinks=S)
    tokens = [tok(p) for p in range(30)]
    tiny(torch.tensor([tokens[:10]]), cache, 0)
    decode(tiny, cache, tokens, 10)
    assert cache.evicted_positions.stop == 22
    cache.truncate(25)  # 25..29 become stale; 4..21 stay evicted
    view = cache.inspect.slot_view()
    assert cache.length == 25 and cache.inspect.held == 7 and list(cache.evicted_positions) == list(range(4, 22))
    assert view.count(FILLED) == 7 and view.count(STALE) == 5 and cache.evicted_last_step == []
    new = tokens[:25] + [tok(p + 100) for p in range(25, 40)]
    got, copied = [], []
    for p in range(25, 40):
        got += decode(tiny, cache, new[:p + 1], p)
        copied.append(cache.inspect.memory_report().copied_bytes)
    assert all(c > 0 for c in copied[:4]) and all(c == 0 for c in copied[4:])  # gathered until the window refills
    lo = [max(S, q - W + 1) for q in range(25)] + [max(22, q - W + 1) for q in range(25, 40)]
    ref = streaming_reference(tiny, new, S, lo)
    assert all((g - ref[q]).abs().max() < 1e-5 for q, g in zip(range(25, 40), got))
    cache.truncate(3)  # only sinks remain: nothing of the new sequence was evicted
    assert cache.length == 3 and len(cache.evicted_positions) == 0 and cache.inspect.slot_view().count(FILLED) == 3
    again = tokens[:3] + [tok(p + 200) for p in range(3, 12)]
    logits = tiny(torch.tensor([again[3:]]), cache, 3)[0, -1]
    assert (logits - no_cache_logits(tiny, again, last=True)).abs().max() < 1e-5


def test_a_failed_step_puts_back_the_position_it_evicted(tiny):
    cache = SinkCache(tiny.config, window=8, sinks=4)
    tokens = [tok(p) for p in range(20)]
    tiny(torch.tensor([tokens[:10]]), cache, 0)
    decode(tiny, cache, tokens, 10)
    twin = cache.clone()

    with pytest.raises(RuntimeError, match="boom"):  # layer 0 already overwrote position 12's slot with 20
        tiny(torch.tensor([[7]]), cache, 20, tracer=FailingTracer())
    assert cache.length == 20 and 12 in cache.slots.held_positions(cache.length)
    assert len(cache.evicted_positions) == len(twin.evicted_positions) == 8
    assert cache.inspect.slot_view() == twin.inspect.slot_view()
    for layer in range(tiny.config.num_layers):
        assert torch.equal(cache.key(layer), twin.key(layer)) and torch.equal(cache.value(layer), twin.value(layer))
    a, b = tiny(torch.tensor([[7]]), cache, 20)[0, -1], tiny(torch.tensor([[7]]), twin, 20)[0, -1]
    assert (a - b).abs().max() < 1e-6
    assert cache.slots.held_positions(cache.length) == twin.slots.held_positions(twin.length)


def test_clone_and_fork_are_independent(tiny):
    cache = SinkCache(tiny.config, window=4, sinks=2)
    tiny(torch.tensor([[tok(p) for p in range(5)]]), cache, 0)
    for twin in (cache.clone(), cache.fork()):
        assert twin.key(0).data_ptr() != cache.key(0).data_ptr() and torch.equal(twin.key(1), cache.key(1))
        decode(tiny, twin, [tok(p) for p in range(12)], 5)
        assert twin.length == 12 and len(twin.evicted_positions) == 6
        assert cache.length == 5 and len(cache.evicted_positions) == 0 and cache.inspect.slot_view().count(FREE) == 1


@pytest.mark.long  # 320 steps
def test_generator_runs_300_steps_with_flat_memory(trained):
    cache = SinkCache(trained.config, window=32, sinks=4)
    gen = Generator(trained, cache)
    gen.prefill("Once upon a time")
    gen.run(320, stop_at_eos=False)
    assert len(gen.history) == 321 and cache.length == len(gen.tokens) - 1 > 300
    assert len(gen.text) > 100
    assert {r.memory.reserved_bytes for r in gen.history} == {kv_bytes(trained.config, 36)}
    assert len(cache.evicted_positions) == cache.length - 36 and cache.evicted_last_step == [cache.length - 33]
    assert gen.history[-1].memory.written_bytes == kv_bytes(trained.config, 1)
    tokens = gen.tokens
    with pytest.raises(ValueError, match="cannot rewind to"):
        gen.rewind(40)  # 40 tokens back is past the window: those positions were evicted
    assert gen.tokens == tokens and cache.length == len(tokens) - 1
    gen.rewind(3)  # within the window
    assert cache.length == len(tokens) - 4 and cache.evicted_positions.stop == len(tokens) - 33
    gen.run(5, stop_at_eos=False)
    assert len(gen.tokens) == len(tokens) + 2 and cache.inspect.held == 36
