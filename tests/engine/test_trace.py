"""Tracing: events and attention recorded as copies, equal to a recomputation, in logical and physical order."""

import pytest
import torch

import kvexplore
from kvexplore import Generator, Tracer, make_cache
from kvexplore.models import model as model_module

PROMPT = "Call me Ishmael. Some years ago"


def run(model, kind, tracer=None, steps=12, **options):
    gen = Generator(model, make_cache(kind, model, max_seq_len=64, **options), tracer=tracer)
    gen.prefill(PROMPT)
    gen.run(steps, stop_at_eos=False)
    return gen


@pytest.mark.parametrize("kind", ["preallocated", "paged", "sink", "quantized"])
def test_traced_and_untraced_runs_give_the_same_tokens(trained, kind):
    tracer = Tracer(capture={"cache", "attention", "qkv", "memory", "timing"})
    assert run(trained, kind, tracer).tokens == run(trained, kind).tokens


def test_no_tracer_means_no_hook_work(trained, monkeypatch):
    def forbidden(*args):
        raise AssertionError("a hook ran without a tracer")

    import kvexplore.models.deltanet
    import kvexplore.models.latent

    # every module calling the hook helper
    for module in (model_module, kvexplore.models.latent, kvexplore.models.deltanet):
        monkeypatch.setattr(module, "hook", forbidden)
    assert len(run(trained, "preallocated").history) == 13


def test_recorded_attention_is_the_softmax_of_recorded_q_and_cached_keys(trained):
    gen = run(trained, "preallocated", Tracer(capture={"attention", "qkv"}), steps=5)
    trace, c = gen.history[-1].trace, trained.config
    S = gen.cache.length
    for layer in range(c.num_layers):
        q = trace.qkv[f"layers.{layer}.attn.q"][0, :, -1]  # (heads, hd) of the newest token
        keys = gen.cache.key(layer)[0, :, :S]  # (kv_heads, S, hd)
        scores = torch.einsum("hd,hsd->hs", q, keys[torch.arange(c.num_heads) // c.kv_groups]) / c.head_dim ** 0.5
        probs = trace.attention(layer)[-1]  # (heads, S)
        assert probs.shape == (c.num_heads, S)
        assert (probs - scores.softmax(-1)).abs().max() < 1e-5
        assert torch.allclose(probs.sum(-1), torch.ones(c.num_heads))
    assert trace.gqa_groups == [[h for h in range(c.num_heads) if h // c.kv_groups == g] for g in range(c.num_kv_heads)]


def test_prefill_records_every_query_row(trained):
    gen = Generator(trained, make_cache("preallocated", trained, max_seq_len=64), tracer=Tracer({"attention"}))
    first = gen.prefill(PROMPT)
    rows = first.trace.attention(0)
    n = len(gen.prompt_tokens)
    assert rows.shape == (n, trained.config.num_heads, n)
    assert torch.all(rows.transpose(0, 1).triu(1) == 0)  # query t reads positions 0..t only
    assert torch.allclose(rows.sum(-1), torch.ones(n, trained.config.num_heads))


def test_records_are_copies(trained):
    tracer = Tracer(capture={"cache", "attention", "qkv"})
    gen = run(trained, "preallocated", tracer, steps=3)
    trace = gen.history[-1].trace
    saved = (trace.attention(2).clone(), trace.qkv["layers.2.attn.k_new"].clone(), list(trace.slots.states),
             trace.events[2])
    for layer in range(trained.config.num_layers):  # in-place writes into the cache storage
        gen.cache.key(layer).zero_()
    gen.rewind(2)
    gen.run(6, stop_at_eos=False)  # more steps append to the history buffer (which may grow and move)
    assert torch.equal(trace.attention(2), saved[0]) and torch.equal(trace.qkv["layers.2.attn.k_new"], saved[1])
    assert trace.slots.states == saved[2] and trace.events[2] == saved[3]


def test_cache_events(trained):
    gen = run(trained, "preallocated", Tracer({"cache"}), steps=3)
    record = gen.history[-1]
    event = record.trace.events[1]
    pos = record.position - 1
    assert (event.layer, event.write, event.read) == (1, (pos, 1), (0, pos + 1))
    assert event.view and event.data_ptr == gen.cache.key(1).data_ptr()  # narrow(2, 0, pos + 1): a view
    assert event.storage_offset == 0 and event.stride == gen.cache.key(1).stride()
    paged = run(trained, "paged", Tracer({"cache"}), steps=3).history[-1].trace.events[1]
    assert not paged.view  # pages are gathered into a new tensor
    concat = run(trained, "concat", Tracer({"cache"}), steps=3)
    ptrs = [r.trace.events[0].data_ptr for r in concat.history]
    # a new storage every step: the old one is alive while the new one is filled, so two steps never share an
    # address (a storage freed steps ago may be reused by the allocator)
    assert all(r.trace.events[0].view for r in concat.history) and all(a != b for a, b in zip(ptrs, ptrs[1:]))


def test_logical_and_physical_orders(trained):
    pre = run(trained, "preallocated", Tracer({"cache", "attention"}), steps=4).history[-1].trace
    S = len(pre.read_positions)
    assert torch.equal(pre.physical_attention(3)[..., :S], pre.attention(3))
    assert pre.physical_attention(3)[..., S:].abs().sum() == 0
    paged = run(trained, "paged", Tracer({"cache", "attention"}), steps=4, block_size=4)
    twin = paged.fork()  # shares every page; from here the two take new pages in turn
    for _ in range(8):
        paged.step()
        twin.step()
    assert paged.cache.block_tables[0] != list(range(len(paged.cache.block_tables[0])))  # pages interleaved
    trace = paged.history[-1].trace
    logical, physical = trace.attention(3)[-1], trace.physical_attention(3)[-1]
    assert torch.equal(logical.sort(-1).values, physical[:, physical.sum(0) > 0].sort(-1).values)
    assert not torch.equal(logical, physical[:, : logical.shape[-1]])  # a permutation, not the identity
    sink = Generator(trained, make_cache("sink", trained, window=8, sinks=2), tracer=Tracer({"cache", "attention"}))
    sink.prefill(PROMPT[:6])
    sink.run(20, stop_at_eos=False)
    trace = sink.history[-1].trace
    logical = trace.attention(0)[-1]
    n = sink.cache.length
    assert sorted(trace.read_positions) == [0, 1, *range(n - 8, n)]  # the sinks and the last 8 positions
    assert (logical.sum(0) > 0).sum() == 10 and logical[:, 2:logical.shape[-1] - 8].abs().sum() == 0  # evicted
    assert torch.equal(trace.physical_attention(0)[-1].sort(-1).values[:, -10:], logical.sort(-1).values[:, -10:])


def test_layer_and_head_selection(trained):
    tracer = Tracer({"attention"}, layers=[1, 4], heads=[0, 5])
    trace = run(trained, "preallocated", tracer, steps=2).history[-1].trace
    assert trace.attention_layers == [1, 4] and trace.attention(4).shape[:2] == (1, 2) and trace.heads == [0, 5]
    with pytest.raises(ValueError, match=r"unknown capture \['attn'\]; choose from"):
        Tracer({"attn"})


def test_save_and_load_round_trip(trained, tmp_path):
    gen = Generator(trained, make_cache("paged", trained, max_seq_len=64, block_size=4),
                    tracer=Tracer({"cache", "attention", "qkv", "memory", "timing"}, layers=[0, 5]))
    gen.prefill(PROMPT)
    gen.run(6, stop_at_eos=False)
    path = gen.history.save(tmp_path / "run.kvtrace")
    loaded = kvexplore.load_trace(path)
    assert len(loaded) == len(gen.history) == 7
    for a, b in zip(gen.history, loaded):
        assert (a.token_id, a.text, a.position, a.top, a.memory, a.prob) == (b.token_id, b.text, b.position, b.top,
                                                                             b.memory, b.prob)
        assert a.trace.events == b.trace.events and a.trace.slots == b.trace.slots
        assert a.trace.read_positions == b.trace.read_positions and a.trace.gqa_groups == b.trace.gqa_groups
        for layer in (0, 5):
            assert torch.equal(a.trace.attention(layer), b.trace.attention(layer))
            assert torch.equal(a.trace.physical_attention(layer), b.trace.physical_attention(layer))
        assert a.trace.qkv.keys() == b.trace.qkv.keys()
        assert all(torch.equal(a.trace.qkv[k], b.trace.qkv[k]) for k in a.trace.qkv)


def test_a_newer_or_foreign_trace_is_refused(trained, tmp_path):
    from safetensors.torch import save_file

    gen = run(trained, "preallocated", steps=1)
    path = gen.history.save(tmp_path / "run.kvtrace")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    save_file({"x": torch.zeros(1)}, tmp_path / "new.kvtrace", metadata=meta | {"version": "99"})
    with pytest.raises(kvexplore.LoadError, match=r"format version 99, newer than this kvexplore reads \(3\); "
                                                  r"upgrade kvexplore"):
        kvexplore.load_trace(tmp_path / "new.kvtrace")
    save_file({"x": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(kvexplore.LoadError, match="is not a kvexplore trace"):
        kvexplore.load_trace(tmp_path / "other.safetensors")
