"""The 2025 architectures against transformers, with caches that differ layer by layer.

Qwen3 (q/k norm), Gemma 3 (sliding and full layers, local and global RoPE), gpt-oss (alternating layers, learned
sinks, experts, YaRN) and Gemma 4 (layers that share an earlier layer's cache, a larger head on full layers,
proportional RoPE). Random weights, float32; windows smaller than the sequence so the rings wrap (40 tokens are
10x a window of 4 and 5x a window of 8).
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvexplore
from helpers import FailingTracer, greedy_tokens_match, make_checkpoint, no_cache_logits

TOL = 1e-4
SEQ = 40
GEMMA4_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                "sliding_attention", "full_attention"]
# name -> (architecture, options)
MODELS = {
    "qwen3": ("qwen3", dict(layers=2)),
    "gemma3-w4": ("gemma3", dict(layers=6, sliding_window=4)),
    "gemma3-w8": ("gemma3", dict(layers=6, sliding_window=8)),
    "gptoss-w4": ("gpt_oss", dict(layers=4, sliding_window=4)),
    "gptoss-w8": ("gpt_oss", dict(layers=4, sliding_window=8)),
    "gemma4-w4": ("gemma4", dict(layers=6, sliding_window=4, layer_types=GEMMA4_TYPES)),
    "gemma4-w8": ("gemma4", dict(layers=6, sliding_window=8, layer_types=GEMMA4_TYPES)),
}
EXACT = ("preallocated", "concat", "paged", "none")


@pytest.fixture(scope="module")
def built(zoo):
    """``built(name) -> (kvexplore model, transformers reference)`` from the session's zoo."""
    def get(name):
        arch, options = MODELS[name]
        return zoo.load(arch, **options), zoo.checkpoint(arch, **options)[1]

    return get


def ids_for(model, n=SEQ, seed=1):
    return torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def stepped(model, kind, ids, prefill, chunk=1):
    """Prefill ``ids[:prefill]``, then feed the rest ``chunk`` tokens at a time (all positions' logits)."""
    cache = kvexplore.make_cache(kind, model, 64)
    if kind == "none":  # no cache: every step recomputes the whole sequence at position 0
        return torch.cat([model(torch.tensor([ids[:prefill]]), cache, 0)[0]] +
                         [model(torch.tensor([ids[:end]]), cache, 0)[0, end - 1:end] for end in
                          range(prefill + 1, len(ids) + 1)]), cache
    out = [model(torch.tensor([ids[:prefill]]), cache, 0)[0]]
    for pos in range(prefill, len(ids), chunk):
        out.append(model(torch.tensor([ids[pos:pos + chunk]]), cache, pos)[0])
    return torch.cat(out), cache


@pytest.mark.parametrize("name", list(MODELS))
def test_prefill_and_decode_match_transformers(built, name):
    model, ref = built(name)
    ids = ids_for(model)
    want = reference_logits(ref, ids)
    full = model(torch.tensor([ids]), kvexplore.make_cache("preallocated", model, 64), 0)[0]
    assert (full - want).abs().max().item() < TOL  # one pass over a prompt 5-10x the window
    for kind in EXACT:
        got, _ = stepped(model, kind, ids, prefill=5)
        assert got.shape == want.shape and (got - want).abs().max().item() < TOL, kind
    got, _ = stepped(model, "preallocated", ids, prefill=3, chunk=7)  # chunks that wrap the rings
    assert (got - want).abs().max().item() < TOL


@pytest.mark.long  # 64 tokens against transformers, per model
@pytest.mark.parametrize("name", list(MODELS))
def test_64_greedy_tokens_match_transformers(built, name):
    model, ref = built(name)
    greedy_tokens_match(model, ref)


def test_the_layer_plans_are_the_models(built):
    gemma3 = built("gemma3-w4")[0]
    assert gemma3.config.layer_types == ["sliding_attention"] * 2 + ["full_attention"] + \
        ["sliding_attention"] * 2 + ["full_attention"]
    assert gemma3.config.rope_for("sliding_attention")[0] == 10000.0
    assert gemma3.config.rope_for("full_attention")[0] == 1_000_000.0
    oss = built("gptoss-w4")[0]
    assert oss.config.layer_types == ["sliding_attention", "full_attention"] * 2 and oss.config.attention_sinks
    assert oss.config.rope_scaling["rope_type"] == "yarn" and oss.config.num_experts == 4
    plan = kvexplore.make_cache("preallocated", built("gemma4-w4")[0], 32).plan
    assert [s.kind for s in plan] == ["sliding", "sliding", "full", "sliding", "shared", "shared"]
    assert [s.source for s in plan][4:] == [3, 2]  # the last stored layer of the same type, not the one before
    assert [s.head_dim for s in plan] == [16, 16, 32, 16, 16, 32]


def test_sinks_experts_and_rope_are_not_vacuous(built, tmp_path):
    """Parity above would prove little if sinks, experts or YaRN changed nothing at these sizes."""
    model, ref = built("gptoss-w4")
    ids = ids_for(model)
    want = reference_logits(ref, ids)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # no sink
    try:
        wrong = model(torch.tensor([ids]), kvexplore.make_cache("preallocated", model, 64), 0)[0]
    finally:
        with torch.no_grad():
            for layer, ref_layer in zip(model.model.layers, ref.model.layers):
                layer.self_attn.sinks.copy_(ref_layer.self_attn.sinks)
    assert (wrong - want).abs().max().item() > 100 * TOL


@pytest.mark.long  # the fast tier's heaviest (1-3 s): a 200-token window
def test_gemma3_window_16_holds_16_positions_in_local_layers_over_200_tokens(tmp_path):
    make_checkpoint(tmp_path, "gemma3", layers=6, sliding_window=16)
    model = kvexplore.load(tmp_path)
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, 256))
    gen.prefill([model.tokenizer.bos_id, *model.tokenizer.encode("The cache keeps")])
    gen.run(200, stop_at_eos=False)
    plan = gen.cache.plan
    per_pos = {s.index: 2 * s.kv_heads * s.head_dim * 4 for s in plan}  # float32 K and V of one position
    previous = None
    for record in gen.history:
        layers = record.memory.per_layer()
        n = record.cache_length
        for m, s in zip(layers, plan):
            assert m.kind == s.kind and m.analytic_bytes == m.logical_bytes
            if s.kind == "sliding":
                assert (m.held == min(n, 16)
                        and m.logical_bytes == min(n, 16) * per_pos[s.index] <= 16 * per_pos[s.index])
                assert m.reserved_bytes == 16 * per_pos[s.index]  # the ring, allocated once
            else:
                assert m.held == n and m.logical_bytes == n * per_pos[s.index]
                if previous is not None:  # a full layer's held bytes grow by one position's K and V a step
                    assert m.logical_bytes - previous[s.index].logical_bytes == per_pos[s.index]
        assert record.memory.logical_bytes == kvexplore.kv_bytes(model.config, n)
        previous = layers
    assert gen.cache.length > 200
    kinds = record.memory.by_kind()
    assert kinds["sliding"]["logical_bytes"] == 4 * 16 * per_pos[0] and kinds["full"]["layers"] == 2


def test_gemma4_shared_layers_store_nothing(built):
    model, ref = built("gemma4-w4")
    ids = ids_for(model)
    got, cache = stepped(model, "preallocated", ids, prefill=5)
    assert (got - reference_logits(ref, ids)).abs().max().item() < TOL
    layers = cache.inspect.memory_report().per_layer()
    for m in layers[4:]:
        assert (m.kind, m.held, m.logical_bytes, m.reserved_bytes, m.written_bytes) == ("shared", 0, 0, 0, 0)
    assert cache.inspect.storage(4) == cache.inspect.storage(3) and cache.inspect.storage(5) == cache.inspect.storage(2)
    # the formula: one full layer of 32-wide heads, three rings of 4 positions of 16-wide heads, nothing shared
    assert cache.inspect.used_bytes == kvexplore.kv_bytes(model.config, SEQ) == 2 * 2 * 4 * (32 * SEQ + 3 * 16 * 4)
    views = cache.inspect.slot_views()
    assert views[4].layout == kvexplore.caches.SharedLayout(source=3) and views[4].states == []


@pytest.mark.parametrize("name", ["gemma3-w4", "gptoss-w4", "gemma4-w4"])
def test_rewind_fork_undo_and_full_caches_hold_for_every_layer_type(built, name):
    model, _ = built(name)
    ids = ids_for(model)
    want, _ = stepped(model, "preallocated", ids, prefill=5)
    cache = kvexplore.make_cache("preallocated", model, 24)
    model(torch.tensor([ids[:20]]), cache, 0)
    # one step back is always possible: the ring still holds what the next query reads
    cache.truncate(19)
    assert (model(torch.tensor([[ids[19]]]), cache, 19)[0] - want[19]).abs().max() < TOL
    # further back the sliding layers have overwritten positions: refused, nothing changed
    with pytest.raises(ValueError, match="sliding-window layers .* no longer hold position"):
        cache.truncate(12)
    assert cache.length == 20
    twin = cache.fork()
    assert (model(torch.tensor([[ids[20]]]), twin, 20)[0] - want[20]).abs().max() < TOL
    assert cache.length == 20 and twin.length == 21
    # a pass that fails part-way (in a later layer) is rolled back exactly, rings included
    before = [t.clone() for layer in range(model.config.num_layers) for t in cache.inspect.storage(layer)]
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.tensor([[ids[20]]]), cache, 20,
              tracer=FailingTracer(f"layers.{model.config.num_layers - 1}.attn.q"))
    after = [t for layer in range(model.config.num_layers) for t in cache.inspect.storage(layer)]
    assert cache.length == 20 and all(torch.equal(a, b) for a, b in zip(before, after))
    assert (model(torch.tensor([[ids[20]]]), cache, 20)[0] - want[20]).abs().max() < TOL
    # full layers still run out of room at capacity, rings or not
    model(torch.tensor([ids[21:24]]), cache, 21)
    with pytest.raises(kvexplore.CacheFullError, match="cache full: 24 of 24"):
        model(torch.tensor([[ids[24]]]), cache, 24)


def test_gemma4_refuses_what_it_does_not_implement(tmp_path):
    import json

    make_checkpoint(tmp_path, "gemma4", layers=6, sliding_window=4, layer_types=GEMMA4_TYPES)
    raw = json.loads((tmp_path / "config.json").read_text())
    for key, value in (("hidden_size_per_layer_input", 8), ("enable_moe_block", True), ("attention_k_eq_v", True)):
        (tmp_path / "config.json").write_text(json.dumps({**raw, key: value}))
        with pytest.raises(kvexplore.UnsupportedModelError, match=f"{key}=.* kvexplore does not implement"):
            kvexplore.load(tmp_path)


@pytest.mark.parametrize("kind", ["preallocated", "paged"])
def test_generator_rewinds_past_the_ring_by_recomputing_it(built, kind):
    """A rewind further back than a sliding layer's ring holds rebuilds the cache from the kept tokens (one pass):
    the run that follows is the run a fresh prefill of them gives."""
    model, _ = built("gemma3-w4")
    gen = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 64))
    gen.prefill(ids_for(model, 6))
    gen.run(12, stop_at_eos=False)
    kept = gen.tokens[:-5]
    assert gen.cache.inspect.needs_replay(len(kept) - 1)
    gen.rewind(5)
    assert gen.tokens == kept and gen.cache.length == len(kept) - 1
    fresh = kvexplore.Generator(model, kvexplore.make_cache(kind, model, 64))
    fresh.prefill(kept[:6])
    for token in kept[6:]:
        fresh.step(force=token)
    again = [r.token_id for r in gen.run(8, stop_at_eos=False)]
    assert again == [r.token_id for r in fresh.run(8, stop_at_eos=False)]
    # a replay that fails leaves the generator and its cache as they were
    before = (list(gen.tokens), gen.cache.length, [t.clone() for t in gen.cache.inspect.storage(0)])
    original = model.forward
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        with pytest.raises(RuntimeError, match="boom"):
            gen.rewind(6)
    finally:
        model.forward = original
    assert (gen.tokens, gen.cache.length) == before[:2]
    assert all(torch.equal(a, b) for a, b in zip(gen.cache.inspect.storage(0), before[2]))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_chunking_and_rewinds_match_recomputation_on_every_layer_kind(built, data):
    """Full, sliding (window 4, rings wrapping) and shared layers: any chunking of 30 tokens, with every rewind the
    rings allow, gives the no-cache logits, on the pre-allocated and the paged cache."""
    model, _ = built("gemma4-w4")
    ids = ids_for(model, 30)
    want = no_cache_logits(model, ids)
    cache = kvexplore.make_cache(data.draw(st.sampled_from(["preallocated", "paged"]), label="kind"), model, 30)
    got = torch.empty_like(want)
    while cache.length < len(ids):
        pos = cache.length
        n = data.draw(st.integers(1, len(ids) - pos), label="chunk")
        got[pos:pos + n] = model(torch.tensor([ids[pos:pos + n]]), cache, pos)[0]
        if data.draw(st.booleans(), label="rewind"):
            to = data.draw(st.integers(0, cache.length), label="to")
            if cache.inspect.needs_replay(to):
                with pytest.raises(ValueError, match="no longer hold position"):
                    cache.truncate(to)
            else:
                cache.truncate(to)
    assert (got - want).abs().max() < TOL
