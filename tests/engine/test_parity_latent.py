"""DeepSeek-V3's multi-head latent attention against transformers, reading kvexplore's latent cache.

The cache holds per layer and position one latent of ``kv_lora_rank`` and one rope key of ``qk_rope_head_dim``,
nothing per head. Both attention paths (absorbed, the default, and decompressed) must give transformers' logits.
Random weights, float32, 40 tokens; a config with low-rank queries and interleaved RoPE, and one with a plain query
projection and YaRN (whose mscale changes the softmax scale).
"""

import pytest
import torch

import kvexplore
from helpers import greedy_tokens_match, no_cache_logits
from kvexplore.models.latent import bytes_per_token

TOL = 1e-4
YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}
CONFIGS = {"low-rank-q": dict(layers=3), "plain-q-yarn": dict(layers=3, q_lora_rank=None, rope_parameters=YARN)}


@pytest.fixture(scope="module")
def deepseek(zoo):
    return lambda name: zoo.checkpoint("deepseek_v3", **CONFIGS[name])


def ids_for(n=40):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(1)).tolist()


def decode(model, kind, ids, prefill=5):
    cache = kvexplore.make_cache(kind, model, 64)
    out = [model(torch.tensor([ids[:prefill]]), cache, 0)[0]]
    for pos in range(prefill, len(ids)):
        out.append(model(torch.tensor([[ids[pos]]]), cache, pos)[0])
    return torch.cat(out), cache


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mla", ["absorbed", "decompressed"])
def test_latent_attention_matches_transformers(deepseek, name, mla):
    folder, ref = deepseek(name)
    model = kvexplore.load(folder, mla=mla)
    ids = ids_for()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    full = no_cache_logits(model, ids)
    assert (full - want).abs().max().item() < TOL
    for kind in ("preallocated", "concat", "paged"):
        got, _ = decode(model, kind, ids)
        assert (got - want).abs().max().item() < TOL, kind


@pytest.mark.long  # 64 tokens against transformers, per model
@pytest.mark.parametrize("name", list(CONFIGS))
def test_64_greedy_tokens_match_transformers(deepseek, name):
    folder, ref = deepseek(name)
    model = kvexplore.load(folder)
    greedy_tokens_match(model, ref)


def test_both_paths_give_the_same_logits(deepseek):
    folder, _ = deepseek("low-rank-q")
    ids = ids_for()
    absorbed, _ = decode(kvexplore.load(folder, mla="absorbed"), "preallocated", ids)
    decompressed, _ = decode(kvexplore.load(folder, mla="decompressed"), "preallocated", ids)
    assert (absorbed - decompressed).abs().max().item() < 1e-5


def test_the_latent_cache_holds_a_latent_and_a_rope_key_per_position(deepseek):
    folder, ref = deepseek("low-rank-q")
    model = kvexplore.load(folder)
    c = model.config
    _, cache = decode(model, "preallocated", ids_for())
    per_token = c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4  # float32
    assert cache.inspect.used_bytes == 40 * per_token == kvexplore.kv_bytes(c, 40)
    assert cache.inspect.reserved_bytes == 64 * per_token
    for m in cache.inspect.memory_report().per_layer():
        assert m.logical_bytes == 40 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert [t.shape for t in cache.inspect.storage(0)] == [(1, 1, 64, c.kv_lora_rank), (1, 1, 64, c.qk_rope_head_dim)]
    sizes = bytes_per_token(c, itemsize=4, gqa_heads=2)
    assert sizes["latent"] == per_token
    assert sizes["per_head"] == (c.num_layers * c.num_heads
                                 * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 4)
    assert sizes["per_head"] / sizes["latent"] == c.num_heads * (12 + 8) / (16 + 4)  # 4 heads x (12 + 8) vs 16 + 4
    assert sizes["gqa"] == sizes["per_head"] // 2
    # what transformers 5.24's own cache holds per layer: the same latent and rope key
    from transformers import DynamicCache

    hf = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(torch.tensor([ids_for()]), past_key_values=hf, use_cache=True)
    assert [tuple(t.shape) for t in (hf.layers[0].keys, hf.layers[0].values)] == [(1, 1, 40, 16), (1, 1, 40, 4)]


def test_the_quantized_cache_refuses_a_latent_cache(deepseek):
    model = kvexplore.load(deepseek("low-rank-q")[0])
    with pytest.raises(kvexplore.SettingsError, match="latent cache .* use preallocated, concat, paged or none"):
        kvexplore.make_cache("quantized", model, 64)
    with pytest.raises(kvexplore.SettingsError, match="unknown mla 'fused'"):
        kvexplore.load(deepseek("low-rank-q")[0], mla="fused")


@pytest.fixture(scope="module")
def sparse(zoo):
    """DeepSeek-V3.2: every query reads the indexer's top 8 of up to 40 positions (32 indexer heads: with few,
    relu makes many scores exactly 0 and the top-k boundary ties, in transformers too)."""
    return zoo.checkpoint("deepseek_v32", layers=3)


@pytest.mark.parametrize("mla", ["absorbed", "decompressed"])
def test_sparse_attention_matches_transformers(sparse, mla):
    folder, ref = sparse
    model = kvexplore.load(folder, mla=mla)
    ids = ids_for()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    for kind in ("preallocated", "paged", "none"):
        if kind == "none":
            got = no_cache_logits(model, ids)
        else:
            got, _ = decode(model, kind, ids)
        assert (got - want).abs().max().item() < TOL, kind
    with torch.no_grad():  # the selection matters: reading every position gives other logits
        ref.config.index_topk = 64
        for layer in ref.model.layers:
            layer.self_attn.indexer.index_topk = 64
        every = ref(torch.tensor([ids])).logits[0].float()
    for layer in ref.model.layers:
        layer.self_attn.indexer.index_topk = 8
    ref.config.index_topk = 8
    assert (every - want).abs().max().item() > 100 * TOL


def test_sparse_reads_are_a_gather_and_the_trace_marks_them(sparse):
    folder, ref = sparse
    model = kvexplore.load(folder)
    c = model.config
    gen = kvexplore.Generator(model, kvexplore.make_cache("preallocated", model, 64),
                              tracer=kvexplore.Tracer(capture={"cache", "attention"}))
    gen.prefill(ids_for(20))
    gen.run(10, stop_at_eos=False)
    t = gen.history[-1].trace
    for layer in range(c.num_layers):
        reads = t.reads_of(layer)
        assert len(reads) == 8 == len(set(reads)) and max(reads) < gen.cache.length  # 8 of 30 positions
        assert t.attention_raw(layer).shape[-1] == 8  # attention saw exactly those keys
        event = next(e for e in t.events if e.layer == layer)
        assert not event.view and event.read_shape[2] == 8  # a gather, not narrow(2, 0, S)
    assert len({tuple(t.reads_of(i)) for i in range(c.num_layers)}) > 1  # each layer picks its own
    from kvexplore.views.cache_map import slot_classes

    classes = slot_classes(gen.history[-1], layer=1)  # the cache map: exactly the positions read are "read"
    newest = gen.cache.length - 1  # written this step (the indexer need not pick it)
    assert {i for i, cls in enumerate(classes) if cls == "read"} == set(t.reads_of(1)) - {newest}
    assert (classes[newest] == "written"
            and classes.count("not read") == gen.cache.length - len(set(t.reads_of(1)) | {newest}))
    per_token = c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim + c.index_head_dim) * 4
    n = gen.cache.length
    assert gen.cache.inspect.used_bytes == n * per_token == bytes_per_token(c, 4)["latent"] * n


def test_sparse_64_greedy_tokens_match_transformers(sparse):
    folder, ref = sparse
    model = kvexplore.load(folder)
    greedy_tokens_match(model, ref, kinds=("preallocated",))


def test_the_cache_map_draws_each_layers_own_sparse_reads(sparse):
    import numpy as np

    from kvexplore.views.palette import SLOT_CLASSES

    ex = kvexplore.Explorer(str(sparse[0]), strategies=("preallocated",), max_seq_len=64)
    ex.run(8)
    heat = ex.specs()["cache_map"].trace("slots")
    z, rows, x = (np.asarray(heat[k]) for k in ("z", "y", "x"))
    trace, newest = ex.lane.history[-1].trace, ex.lane.cache.length - 1
    drawn = [set(x[(rows == layer) & (z == SLOT_CLASSES.index("read"))].tolist()) for layer in range(3)]
    assert drawn == [set(trace.reads_of(layer)) - {newest} for layer in range(3)]
    assert len({frozenset(d) for d in drawn}) > 1  # each layer's row is its own
