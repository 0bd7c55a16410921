"""Ready for CUDA, checked on the CPU: no host conversion outside kvexplore.core.host, few syncs, the allocator's
figures measured around the cache's writes, and tracing that changes nothing in bfloat16 and float16.

``devicemode.PretendDevice`` marks the tensors that would live on the GPU and fails on any conversion of one to
Python or NumPy outside :mod:`kvexplore.core.host` (and on an operation mixing device and host tensors);
``fake_allocator.FakeAllocator`` stands in for CUDA's allocator statistics.
"""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.core import host
from devicemode import HostConversion, MixedDevices, PretendDevice, is_device
from fake_allocator import FakeAllocator
from helpers import make_checkpoint

KINDS = ("preallocated", "concat", "none", "paged", "quantized", "sink")
GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention"]
# architecture -> (checkpoint options, layers whose experts make one deliberate sync each per step)
ARCHS = {
    "llama": (dict(), 0),
    "gemma3": (dict(layers=3), 0),
    "gemma4": (dict(layers=6, sliding_window=4, layer_types=GEMMA4_TYPES), 0),
    "gpt_oss": (dict(layers=2), 2),
    "deepseek_v32": (dict(layers=2), 1),
    "qwen3_next": (dict(layers=4), 3),  # mlp_only_layers=[1]: the other three route to experts
}
PROMPT = list(range(3, 17))


@pytest.fixture(scope="module")
def models(zoo):
    return lambda arch: zoo.load(arch, **ARCHS[arch][0])


def kinds_for(model):
    return [k for k in KINDS if not (k == "quantized" and model.config.kv_lora_rank)]


def test_the_pretend_device_catches_conversions_and_mixed_devices(tiny):
    with PretendDevice(tiny):
        w = tiny.model.embed_tokens.weight
        assert is_device(w) and is_device(w.sum()) and is_device(torch.zeros(3, device=tiny.device))
        assert not is_device(torch.zeros(3))  # made on the host
        for convert in (lambda: w.sum().item(), lambda: w[0].tolist(), lambda: float(w[0, 0]),
                        lambda: w.numpy(), lambda: bool(w[0, 0] > 0), lambda: w.cpu()):
            with pytest.raises(HostConversion, match="outside kvexplore.core.host"):
                convert()
        with pytest.raises(MixedDevices, match="mixes device tensors with a host tensor"):
            w[:3] + torch.ones(3, w.shape[1])
        (landed,) = host.fetch([w[:2]])
        assert not is_device(landed) and torch.equal(landed, w[:2].as_subclass(torch.Tensor))
    assert not is_device(tiny.model.embed_tokens.weight)  # put back


def test_packing_for_one_transfer_keeps_every_dtype_and_shape():
    ts = [torch.randn(3, 5)[:, ::2], torch.tensor([True, False, True]), torch.arange(7), torch.randn(2, 3).bfloat16(),
          torch.randn(4).half(), torch.empty(0, 3), torch.tensor(2.5, dtype=torch.float64)]
    packed, places = host.pack(ts)
    assert packed.dtype == torch.uint8 and packed.dim() == 1
    back = host.unpack(packed.clone(), places)
    assert all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t) for b, t in zip(back, ts))


@pytest.mark.long  # every cache, with and without a tracer
@pytest.mark.parametrize("arch", list(ARCHS))
def test_generator_every_cache_and_the_tracer_convert_only_through_host(models, arch):
    """Greedy and sampled runs, with and without a full tracer, rewind and fork: nothing converts a device tensor
    to the host outside kvexplore.core.host, and a step syncs once (plus once per expert layer, plus once for a
    trace)."""
    model = models(arch)
    expert_syncs = ARCHS[arch][1]
    for kind in kinds_for(model):
        with PretendDevice(model) as mode:
            cache = kvexplore.make_cache(kind, model, max_seq_len=64)
            plain = kvexplore.Generator(model, cache, seed=3)
            plain.prefill(PROMPT)
            layers = range(model.config.num_layers)
            assert any(is_device(t) for layer in layers for t in cache.inspect.storage(layer)) or \
                kind == "none"  # the cache's storage counts as device memory here
            before, uploads = mode.transfers, mode.uploads
            plain.step()
            assert mode.transfers - before == 1 + expert_syncs, kind
            assert mode.upload_sites[uploads:] == [], kind  # token ids and tables go up without a blocking copy
            plain.run(3)
            plain.rewind(2)
            plain.fork().step()
            tracer = kvexplore.Tracer(capture={"cache", "attention", "qkv", "memory", "timing"})
            traced = kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=64), tracer=tracer,
                                         temperature=0.8, top_k=20, top_p=0.9, seed=3)
            traced.prefill(PROMPT)
            before = mode.transfers
            record = traced.step()
            assert mode.transfers - before == 2 + expert_syncs, kind
            traced.run(2)
        trace = record.trace
        assert all(not is_device(t) for t in trace.qkv.values()) and trace.qkv  # captured q/k/v live on the host
        assert trace.attention_layers and not is_device(trace.attention_raw(trace.attention_layers[0]))


@pytest.mark.parametrize("options", [{}, {"storage": "mask"}, {"decode_every": 4, "positions": "rerotate"}])
def test_an_evict_cache_syncs_once_per_decode_step_between_presses(tiny, options):
    """A press reads its scores and choices on the host (a sync each, at the press); a decode step between presses
    syncs once, for the logits, and its memory report reads each head's count from the host."""
    with PretendDevice(tiny, allow=("caches/layers/",)) as mode:
        gen = kvexplore.Generator(tiny, kvexplore.make_cache("evict", tiny, max_seq_len=96, **options), seed=3)
        gen.prefill(PROMPT)
        # the prompt was pressed: its reads are the press's
        assert gen.cache.eviction.press_events and mode.allowed_sites
        for _ in range(3):
            before, uploads, reads = mode.transfers, mode.uploads, len(mode.allowed_sites)
            presses = len(gen.cache.eviction.press_events)
            gen.step()
            if len(gen.cache.eviction.press_events) == presses:
                assert mode.transfers - before == 1 and mode.upload_sites[uploads:] == [] and \
                    mode.allowed_sites[reads:] == [], options
        assert gen.cache.inspect.memory_report().held_bytes > 0


def test_perplexity_syncs_once_per_window(tiny):
    ids = list(range(3, 60))
    want = kvexplore.perplexity(tiny, ids, window=20)
    with PretendDevice(tiny) as mode:
        got = kvexplore.perplexity(tiny, ids, window=20)
    assert got == pytest.approx(want) and mode.transfers == 3  # three windows, one sum brought over each (the
    # range check of the ids reads them on the host)


def test_sampling_on_the_host_draws_the_same_tokens(tiny):
    def run():
        g = kvexplore.Generator(tiny, temperature=1.2, top_k=40, seed=11)
        g.prefill(PROMPT)
        g.run(12)
        return g.tokens

    outside = run()
    with PretendDevice(tiny):
        inside = run()
    assert inside == outside


@pytest.mark.sampled
@pytest.mark.parametrize("arch", ["llama", "gemma4", "qwen3_next", "deepseek_v32"])
def test_every_explorer_view_converts_only_through_host(models, arch):
    pytest.importorskip("plotly")
    model = models(arch)
    with PretendDevice(model) as mode:
        ex = kvexplore.Explorer(model, strategies=tuple(kinds_for(model)), max_seq_len=48)
        ex.session.prefill(PROMPT)
        ex.session.step()
        lanes = len(ex.session.lanes)
        before = mode.transfers
        ex.session.step()
        per_lane = (mode.transfers - before) / lanes
        for layer in range(model.config.num_layers):
            ex.layer = layer
            for lane in ex.session.lanes:
                ex.controls["lane"].value = lane
                specs = ex.specs()
        ex.session.rewind(1)
        ex.session.fork()
        specs = ex.specs()
    assert set(specs) >= {"cache_map", "memory", "attention", "tensors", "compare"}
    expert_syncs = ARCHS[arch][1]
    assert per_lane == 2 + expert_syncs  # the logits, and the lane tracer's one landing (was 3 per layer)


def test_untraced_decode_syncs_at_most_twice_on_smollm2_shape(tmp_path):
    """The issue's bound on a SmolLM2-like layout (GQA 3:1, tied embeddings): one sync per decode step."""
    make_checkpoint(tmp_path, "llama", hidden=96, layers=6, heads=6, kv_heads=2, tied=True, tokenizer=False)
    model = kvexplore.load(tmp_path)
    with PretendDevice(model) as mode:
        g = kvexplore.Generator(model)
        g.prefill(PROMPT)
        before = mode.transfers
        g.run(20)
    assert mode.transfers - before == 20  # at most 2 per step is the bound; one is what it takes


# -- memory figures measured where the claim is made ---------------------------------------------------------
def allocator_run(model, kind, steps=6):
    cache = kvexplore.make_cache(kind, model, max_seq_len=64)
    fake = FakeAllocator()
    cache.allocator = fake
    g = kvexplore.Generator(model, cache)
    with fake:
        g.prefill(PROMPT)
        g.run(steps)
    return g


def test_preallocated_cache_allocates_nothing_per_step_while_the_forward_pass_does(tiny):
    g = allocator_run(tiny, "preallocated")
    for r in g.history[1:]:
        assert r.memory.cuda == {"allocated_bytes": 0, "freed_bytes": 0, "allocations": 0, "frees": 0}
    # the forward pass itself allocated (activations, logits): those were outside the cache's windows
    assert g.history[-1].memory.cuda_now["allocated_bytes"] > 0


def test_concat_cache_shows_its_allocate_and_free_per_step(tiny):
    g = allocator_run(tiny, "concat")
    c = tiny.config
    for r in g.history[1:]:
        n = r.cache_length
        grown, old = kvexplore.kv_bytes(c, n), kvexplore.kv_bytes(c, n - 1)
        assert r.memory.cuda == {"allocated_bytes": grown, "freed_bytes": old, "allocations": 2 * c.num_layers,
                                 "frees": 2 * c.num_layers}
        # the cache's own bookkeeping says the same
        assert (r.memory.allocated_bytes, r.memory.freed_bytes) == (grown, old)


def test_no_cache_reports_every_step(tiny):
    g = allocator_run(tiny, "none")
    reports = [r.memory for r in g.history]
    assert len({id(m) for m in reports}) == len(reports)
    assert all(m.cuda == dict.fromkeys(("allocated_bytes", "freed_bytes", "allocations", "frees"), 0)
               for m in reports)


def test_a_failed_step_leaves_the_allocator_figures_as_they_were(tiny):
    g = allocator_run(tiny, "concat", steps=2)
    before = dict(g.history[-1].memory.cuda)
    g.temperature = 1e-45  # logits / temperature overflow: the step is refused after the forward pass
    with pytest.raises(kvexplore.StepError):
        g.step()
    assert g.cache.inspect.memory_report().cuda == before


# -- exact tracing in low precision ----------------------------------------------------------------------
def teacher_forced_logits(model, kind, ids, tracer=None):
    cache = kvexplore.make_cache(kind, model, max_seq_len=96)
    out = []
    if kind == "none":
        for n in range(8, len(ids) + 1):
            tracer and tracer.begin_step(cache, 0, n)
            out.append(model(ids[None, :n], cache, 0, tracer=tracer, last_only=True)[0, -1])
            tracer and tracer.end_step(cache)
        return torch.stack(out)
    tracer and tracer.begin_step(cache, 0, 8)
    out.append(model(ids[None, :8], cache, 0, tracer=tracer, last_only=True)[0, -1])
    tracer and tracer.end_step(cache)
    for p in range(8, len(ids)):
        tracer and tracer.begin_step(cache, p, 1)
        out.append(model(ids[None, p:p + 1], cache, p, tracer=tracer)[0, -1])
        tracer and tracer.end_step(cache)
    return torch.stack(out[:-1] + out[-1:])


@pytest.mark.long  # every cache, plain and traced, in two dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tracing_does_not_change_low_precision_logits(checkpoint, dtype):
    folder, _ = checkpoint("llama-gqa2")
    model = kvexplore.load(folder, dtype=dtype)
    ids = torch.randint(3, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    for kind in KINDS:
        plain = teacher_forced_logits(model, kind, ids)
        traced = teacher_forced_logits(model, kind, ids, kvexplore.Tracer(capture={"cache", "attention", "qkv"}))
        assert torch.equal(plain, traced), kind  # the trace observes; SDPA still computes the output
        g_plain, g_traced = (kvexplore.Generator(model, kvexplore.make_cache(kind, model, max_seq_len=96),
                                                 tracer=t) for t in (None, kvexplore.Tracer(capture={"attention"})))
        for g in (g_plain, g_traced):
            g.prefill(ids[:10])
            g.run(30, stop_at_eos=False)
        assert g_plain.tokens == g_traced.tokens, kind


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_recorded_attention_is_a_float32_softmax_of_the_scores(checkpoint, dtype):
    folder, _ = checkpoint("llama-gqa2")
    model = kvexplore.load(folder, dtype=dtype)
    cache = kvexplore.make_cache("preallocated", model, max_seq_len=64)
    g = kvexplore.Generator(model, cache, tracer=kvexplore.Tracer(capture={"attention", "qkv"}))
    g.prefill(PROMPT)
    record = g.step()
    c = model.config
    q = record.trace.qkv["layers.1.attn.q"][0, :, -1].float()  # (heads, hd), rounded to the dtype as computed
    k = cache.key(1)[0, :, : cache.length].float().repeat_interleave(c.num_heads // c.num_kv_heads, 0)
    want = ((q[:, None, :] @ k.transpose(-1, -2))[:, 0] * c.attention_scale(1)).softmax(-1)  # float32 throughout
    got = record.trace.attention(1)[-1]
    assert got.dtype == torch.float32
    assert (got - want).abs().max() < 1e-5  # scores rounded to bf16/fp16 before the softmax would be ~1e-2 off


def test_rope_tables_stay_float32_whatever_to_does(checkpoint):
    folder, _ = checkpoint("llama-gqa2")
    exact = kvexplore.load(folder)
    model = kvexplore.load(folder).to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.rotary.inv_freq.dtype == torch.float32
    for a, b in zip(model.rotary.cos_sin(1000, 4, torch.float32), exact.rotary.cos_sin(1000, 4, torch.float32)):
        assert torch.equal(a, b)
    half = kvexplore.load(folder).half()
    assert half.rotary.inv_freq.dtype == torch.float32


# -- regressions -----------------------------------------------------------------------------------------
def test_quantized_lane_tensors_view_with_the_error_on_the_device(tiny):
    pytest.importorskip("plotly")
    from kvexplore.views import tensors

    with PretendDevice(tiny):
        ex = kvexplore.Explorer(tiny, strategies=("preallocated", "quantized"), max_seq_len=48)
        ex.session.prefill(PROMPT)
        ex.session.step()
        ex.controls["lane"].value = "quantized"
        snap = ex.snapshot()
        error = snap.lane.detail.stored_error
        assert error is not None and not is_device(error)
        fig = tensors.from_snapshot(snap)
    assert fig.trace("quantization error")["z"].size == error.numel() > 0


def test_physical_attention_of_a_no_cache_trace(tiny):
    g = kvexplore.Generator(tiny, kvexplore.make_cache("none", tiny),
                            tracer=kvexplore.Tracer(capture={"cache", "attention"}))
    g.prefill(PROMPT)
    record = g.step()
    t = record.trace
    physical = t.physical_attention(0)  # no cache: no slot holds anything, so no column
    assert physical.shape == (*t.attention_raw(0).shape[:2], 0)
    assert t.attention(0).shape[-1] == record.position  # the logical view has every position it recomputed


def test_the_memory_view_draws_the_allocator_figures_of_each_step(tiny):
    pytest.importorskip("plotly")
    from kvexplore.views import memory

    g = allocator_run(tiny, "concat")
    fig = memory.spec({"concat": list(g.history)}, cuda=True)
    traces = [t for t in fig.traces if "allocator allocated" in t.get("name", "")]
    assert traces, [t.get("name") for t in fig.traces]
    assert list(traces[0]["y"]) == [r.memory.cuda_now["allocated_bytes"] for r in g.history]
