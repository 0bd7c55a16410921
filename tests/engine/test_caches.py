"""The pre-allocated cache writes in place and reads views; NoCache keeps nothing; bytes follow the formula."""

import pytest
import torch

import kvexplore
from helpers import FailingTracer
from kvexplore import CacheFullError, NoCache, PreallocatedCache, kv_bytes
from helpers import no_cache_logits


def test_storage_shape_and_bytes_match_the_formula(tiny):
    c = tiny.config
    cache = PreallocatedCache(c, 40, batch_size=3, dtype=torch.float16)
    assert cache.key(0).shape == cache.value(1).shape == (3, c.num_kv_heads, 40, c.head_dim)
    live = sum(cache.key(i).nbytes + cache.value(i).nbytes for i in range(c.num_layers))
    formula = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2 * 3 * 40
    assert cache.inspect.reserved_bytes == live == formula == kv_bytes(c, 40, 3, torch.float16)
    assert cache.inspect.used_bytes == 0 and cache.capacity == 40 and cache.length == 0


def test_writes_in_place_and_reads_views(tiny):
    cache = PreallocatedCache(tiny.config, 32)
    ptrs = [cache.key(i).data_ptr() for i in range(tiny.config.num_layers)]
    seen = []

    class Spy:  # record what attention reads through the cache interface
        def __getattr__(self, name):
            return getattr(cache, name)

        def write(self, layer, pos, k, v, queries=None):
            k_all, v_all = cache.write(layer, pos, k, v, queries)
            seen.append((layer, pos, k.shape[2], k_all, v_all))
            return k_all, v_all

    tiny(torch.tensor([[5, 6, 7, 8, 9]]), Spy(), 0)
    tiny(torch.tensor([[10]]), Spy(), 5)
    for layer, pos, q_len, k_all, v_all in seen:
        assert k_all.shape[2] == v_all.shape[2] == pos + q_len
        assert k_all.data_ptr() == cache.key(layer).data_ptr()  # a view on the storage, not a copy
        assert k_all._base is cache.key(layer) and v_all._base is cache.value(layer)
    assert [cache.key(i).data_ptr() for i in range(tiny.config.num_layers)] == ptrs  # never reallocated
    assert cache.length == 6 and cache.inspect.used_bytes == kv_bytes(tiny.config, 6)
    assert cache.key(0)[:, :, 6:].abs().sum() == 0  # nothing written past the end


def test_cached_keys_are_the_rotated_keys(tiny):
    """Keys are stored after RoPE: slot p holds k_proj(x_p) rotated by position p."""
    seen = {}

    class Tracer:
        def hook(self, name, t):
            if name == "layers.0.attn.k_new":
                seen["k"] = t.clone()

        def wants_attention(self, layer):
            return False

    cache = PreallocatedCache(tiny.config, 16)
    tiny(torch.tensor([[4, 5, 6]]), cache, 0)
    tiny(torch.tensor([[7]]), cache, 3, tracer=Tracer())
    assert torch.equal(cache.key(0)[:, :, 3:4], seen["k"])
    x = tiny.model.layers[0].input_layernorm(tiny.model.embed_tokens(torch.tensor([[7]])))
    raw = tiny.model.layers[0].self_attn.k_proj(x).view(1, 1, -1, tiny.config.head_dim).transpose(1, 2)
    assert not torch.allclose(raw, seen["k"], atol=1e-3)  # position 3 rotates it


def test_cache_full_writes_nothing(tiny):
    cache = PreallocatedCache(tiny.config, 8)
    tiny(torch.tensor([[3, 4, 5, 6, 7, 8]]), cache, 0)
    before = [cache.key(i).clone() for i in range(tiny.config.num_layers)]
    with pytest.raises(CacheFullError) as err:
        tiny(torch.tensor([[9, 10, 11]]), cache, 6)
    assert str(err.value) == ("cache full: 6 of 8 slots used and this write needs 3 more (9 > 8); create the cache "
                              "with a larger max_seq_len (at least 9) or rewind")
    assert (err.value.used, err.value.needed, err.value.capacity) == (6, 3, 8)
    assert cache.length == 6
    assert all(torch.equal(cache.key(i), before[i]) for i in range(tiny.config.num_layers))


def test_write_must_not_leave_a_gap(tiny):
    cache = PreallocatedCache(tiny.config, 8)
    tiny(torch.tensor([[3, 4]]), cache, 0)
    with pytest.raises(ValueError, match=r"write at position 4 but the cache holds 2 positions"):
        tiny(torch.tensor([[5]]), cache, 4)
    assert cache.length == 2


def test_truncate_and_overwrite(tiny):
    cache = PreallocatedCache(tiny.config, 8)
    tiny(torch.tensor([[3, 4, 5, 6]]), cache, 0)
    stale = cache.key(0)[:, :, 2:4].clone()
    cache.truncate(2)
    assert cache.length == 2 and torch.equal(cache.key(0)[:, :, 2:4], stale)  # rewind only moves the length
    with pytest.raises(ValueError, match=r"cannot truncate to 5: the cache holds 2 positions"):
        cache.truncate(5)
    tiny(torch.tensor([[9]]), cache, 2)
    assert cache.length == 3 and not torch.equal(cache.key(0)[:, :, 2], stale[:, :, 0])


def test_clone_is_independent(tiny):
    cache = PreallocatedCache(tiny.config, 8)
    tiny(torch.tensor([[3, 4, 5]]), cache, 0)
    twin = cache.clone()
    assert twin.length == 3 and twin.key(0).data_ptr() != cache.key(0).data_ptr()
    assert torch.equal(twin.key(1), cache.key(1))
    tiny(torch.tensor([[6]]), twin, 3)
    assert twin.length == 4 and cache.length == 3
    assert cache.key(0)[:, :, 3].abs().sum() == 0


def test_cache_dtype_and_batch_must_match(tiny):
    with pytest.raises(ValueError, match="cache holds torch.float16 on cpu but the model runs torch.float32"):
        tiny(torch.tensor([[3]]), PreallocatedCache(tiny.config, 4, dtype=torch.float16), 0)
    with pytest.raises(ValueError, match=r"batch of 2 sequences but the cache was made for batch_size=1"):
        tiny(torch.tensor([[3], [4]]), PreallocatedCache(tiny.config, 4), 0)
    with pytest.raises(ValueError, match="max_seq_len must be at least 1"):
        PreallocatedCache(tiny.config, 0)


def test_batched_decode_matches_single_sequences(tiny):
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    cache = PreallocatedCache(tiny.config, 8, batch_size=2)
    both = torch.cat([tiny(ids[:, :3], cache, 0), tiny(ids[:, 3:4], cache, 3), tiny(ids[:, 4:], cache, 4)], 1)
    for b in range(2):
        alone = no_cache_logits(tiny, ids[b:b + 1], batched=True)[0]
        assert (both[b] - alone).abs().max() < 1e-4


def test_no_cache_keeps_nothing(tiny):
    cache = NoCache(tiny.config)
    tiny(torch.tensor([[3, 4, 5]]), cache, 0)
    assert cache.length == 0 and cache.inspect.reserved_bytes == cache.inspect.used_bytes == 0
    assert cache.capacity is None
    with pytest.raises(ValueError, match="write at position 3 but the cache holds 0 positions"):
        tiny(torch.tensor([[6]]), cache, 3)


def test_model_rejects_bad_ids(tiny):
    cache = PreallocatedCache(tiny.config, 8)
    with pytest.raises(ValueError, match=r"token id 99999 is outside the vocabulary \(0..\d+\)"):
        tiny(torch.tensor([[3, 99999]]), cache, 0)
    with pytest.raises(ValueError, match=r"ids must be an integer tensor \[batch, seq\], got \(3,\)"):
        tiny(torch.tensor([3, 4, 5]), cache, 0)
    with pytest.raises(ValueError, match="ids has no tokens"):
        tiny(torch.zeros(1, 0, dtype=torch.long), cache, 0)
    assert cache.length == 0


def test_a_failure_mid_forward_puts_the_overwritten_slots_back(tiny):
    cache = PreallocatedCache(tiny.config, 16)
    tiny(torch.tensor([[3, 4, 5, 6]]), cache, 0)
    before = [cache.key(i).clone() for i in range(tiny.config.num_layers)]
    report = cache.inspect.memory_report()

    with pytest.raises(RuntimeError, match="boom"):
        tiny(torch.tensor([[7, 8]]), cache, 2, tracer=FailingTracer())  # layer 0 already overwrote slots 2..3
    assert cache.length == 4
    assert cache.inspect.memory_report() is report
    for i in range(tiny.config.num_layers):
        assert torch.equal(cache.key(i), before[i])


def test_hook_point_names_are_pinned():
    assert kvexplore.hook_point_names(2) == [
        "embed",
        "layers.0.attn.q", "layers.0.attn.k_new", "layers.0.attn.v_new", "layers.0.attn.cache_write",
        "layers.0.attn.cache_read", "layers.0.attn.scores", "layers.0.attn.probs", "layers.0.attn.out",
        "layers.0.mlp.out",
        "layers.1.attn.q", "layers.1.attn.k_new", "layers.1.attn.v_new", "layers.1.attn.cache_write",
        "layers.1.attn.cache_read", "layers.1.attn.scores", "layers.1.attn.probs", "layers.1.attn.out",
        "layers.1.mlp.out",
        "norm", "logits",
    ]


def test_the_write_side_refuses_a_layer_of_another_kind_and_changes_nothing(tiny):
    """A shared read of a layer that stores its own cache, and a state of a model without linear-attention layers,
    are refused naming what to do, before anything moves."""
    cache = PreallocatedCache(tiny.config, max_seq_len=16)
    tiny(torch.tensor([[5, 6, 7]]), cache, 0)
    before = (cache.length, cache.inspect.slot_view(), cache.inspect.memory_report())
    with pytest.raises(kvexplore.SettingsError, match=r"layer 0 stores its own cache \(full\); write it with "
                                                      r"write\(\)"):
        cache.read_shared(0)
    assert cache.states is None  # no linear-attention layer: no states to ask
    assert (cache.length, cache.inspect.slot_view(), cache.inspect.memory_report()) == before
