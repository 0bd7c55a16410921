"""The paged cache: same logits and tokens as the other strategies, pages shared by forks and copied on write,
a full pool that writes nothing, rewinds that give pages back, slot views and exact memory figures."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvexplore import CacheFullError, Generator, NoCache, PreallocatedCache, kv_bytes
from kvexplore.caches import FILLED, FREE, SHARED, STALE, PagedLayout
from kvexplore.caches.strategies.paged import PagedCache, PagePoolFullError
from helpers import no_cache_logits


def recompute(model, tokens):
    return no_cache_logits(model, tokens, last=True)


def greedy(model, cache, tokens, n):
    """``n`` greedy tokens after ``tokens``, feeding what ``cache`` does not hold yet."""
    tokens = list(tokens)
    for _ in range(n):
        logits = model(torch.tensor([tokens[cache.length:]]), cache, cache.length)[0, -1]
        tokens.append(int(logits.argmax()))
    return tokens


def pools(cache):
    return [t.clone() for t in (*cache.pool.k, *cache.pool.v)]


@pytest.mark.parametrize("which", ["tiny", "trained"])
def test_logits_match_recomputation_across_page_boundaries(tiny, trained, which):
    model = tiny if which == "tiny" else trained
    paged, pre = PagedCache(model.config, 32, block_size=4), PreallocatedCache(model.config, 32)
    tokens = [1, 5, 6, 7, 8, 9]
    feeds = [tokens, [10, 11, 12]] + [[13 + i] for i in range(12)]  # prefill, a 3-token chunk, decode steps
    pos = 0
    for feed in feeds:
        if pos:
            tokens = tokens + feed
        a, b = model(torch.tensor([feed]), paged, pos)[0, -1], model(torch.tensor([feed]), pre, pos)[0, -1]
        assert torch.equal(a, b)  # the same K/V, gathered in logical order: bit-identical to a contiguous cache
        assert torch.allclose(a, recompute(model, tokens), atol=1e-5, rtol=1e-6)
        pos += len(feed)
    assert paged.length == 21 and paged.block_tables == [[0, 1, 2, 3, 4, 5]] and paged.pool.free_blocks == 2


def test_fork_shares_pages_and_copies_the_partial_page_on_write(trained):
    c = trained.config
    cache = PagedCache(c, num_blocks=8, block_size=4)
    history = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13]  # 10 positions: pages 0, 1 full, page 2 holds 2 slots
    trained(torch.tensor([history]), cache, 0)
    assert cache.block_tables == [[0, 1, 2]] and cache.pool.free_blocks == 5
    twin = cache.fork()
    assert twin.pool.free_blocks == cache.pool.free_blocks == 5 and twin.block_tables == cache.block_tables
    assert twin.pool is cache.pool and twin.pool.k[0] is cache.pool.k[0]  # the same tensors
    assert cache.pool.refcount[:3] == [2, 2, 2] and twin.length == 10
    trained(torch.tensor([[20]]), twin, 10)  # first divergent write: into the shared page 2
    r = twin.inspect.memory_report()
    assert (r.allocations, r.allocated_bytes) == (1, twin.table.page_bytes)
    assert r.copied_bytes == kv_bytes(c, 2) and r.written_bytes == kv_bytes(c, 1)
    assert twin.block_tables == [[0, 1, 3]] and cache.block_tables == [[0, 1, 2]] and cache.pool.free_blocks == 4
    assert cache.pool.refcount[:4] == [2, 2, 1, 1]
    for pool in (*cache.pool.k, *cache.pool.v):
        assert torch.equal(pool[3, :, :2], pool[2, :, :2])  # the copied slots
    trained(torch.tensor([[30]]), cache, 10)  # the original now owns page 2 alone: written in place
    r = cache.inspect.memory_report()
    assert (r.allocations, r.copied_bytes, cache.block_tables) == (0, 0, [[0, 1, 2]])
    cache.truncate(10)
    twin.truncate(10)  # both keep their own page 2 and continue past page boundaries from the divergent token
    a = greedy(trained, cache, history + [30], 9)
    b = greedy(trained, twin, history + [20], 9)
    assert a == greedy(trained, PreallocatedCache(c, 32), history + [30], 9)
    assert b == greedy(trained, PreallocatedCache(c, 32), history + [20], 9)
    assert torch.allclose(trained(torch.tensor([[a[-1]]]), cache, 19)[0, -1], recompute(trained, a), atol=1e-5)
    assert torch.allclose(trained(torch.tensor([[b[-1]]]), twin, 19)[0, -1], recompute(trained, b), atol=1e-5)


def test_a_full_pool_writes_nothing(trained):
    cache = PagedCache(trained.config, num_blocks=3, block_size=4)
    trained(torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13]]), cache, 0)
    twin = cache.fork()
    state = (pools(cache), cache.block_tables, cache.pool.refcount[:], cache.inspect.memory_report(),
             twin.inspect.memory_report())
    with pytest.raises(PagePoolFullError) as err:
        trained(torch.tensor([[20]]), twin, 10)  # needs a copy of the shared page 2: no page is free
    assert isinstance(err.value, CacheFullError)
    assert str(err.value) == ("page pool full: 3 of 3 pages in use (0 free) and this write needs 1 new page; create "
                              "the cache with a larger num_blocks or max_seq_len, or rewind this sequence, or free a "
                              "fork (truncate(0) or drop it)")
    assert (err.value.used, err.value.needed, err.value.capacity, err.value.free) == (3, 1, 3, 0)
    with pytest.raises(PagePoolFullError, match="needs 2 new pages"):
        trained(torch.tensor([[20, 21, 22]]), cache, 10)  # a copy of page 2 and one page past it
    assert twin.length == cache.length == 10 and twin.block_tables == cache.block_tables == state[1]
    assert cache.pool.free_blocks == 0 and cache.pool.refcount == state[2] and twin.capacity == cache.capacity == 10
    assert all(torch.equal(a, b) for a, b in zip(pools(cache), state[0]))
    assert (cache.inspect.memory_report(), twin.inspect.memory_report()) == state[3:]
    twin.truncate(0)  # freeing the fork: the original owns its pages again
    assert cache.pool.refcount == [1, 1, 1] and cache.pool.free_blocks == 0 and cache.capacity == 12
    trained(torch.tensor([[20, 21]]), cache, 10)
    assert cache.length == 12 and cache.inspect.memory_report().allocations == 0
    capped = PagedCache(trained.config, 6, block_size=4, num_blocks=10)  # max_seq_len caps one sequence
    trained(torch.tensor([[1, 5, 6, 7]]), capped, 0)
    with pytest.raises(CacheFullError, match=r"cache full: 4 of 6 slots used and this write needs 3 more"):
        trained(torch.tensor([[7, 8, 9]]), capped, 4)
    assert capped.capacity == 6 and capped.pool.free_blocks == 9


def test_truncate_gives_pages_back(trained):
    c = trained.config
    cache = PagedCache(c, 16, block_size=4)
    trained(torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13]]), cache, 0)
    assert cache.pool.free_blocks == 1 and cache.capacity == 16
    cache.truncate(5)
    r = cache.inspect.memory_report()
    assert cache.block_tables == [[0, 1]] and cache.pool.free_blocks == 2
    assert (r.frees, r.freed_bytes) == (1, cache.table.page_bytes)
    twin = cache.fork()
    twin.truncate(3)  # drops its reference to page 1, which the original still holds
    assert twin.block_tables == [[0]] and cache.pool.free_blocks == 2 and cache.pool.refcount[:2] == [2, 1]
    assert twin.inspect.memory_report().frees == 0
    cache.truncate(0)
    assert cache.block_tables == [[]] and cache.pool.free_blocks == 3 and cache.inspect.memory_report().frees == 1
    twin.truncate(0)
    assert cache.pool.free_blocks == 4 and cache.pool.refcount == [0] * 4
    with pytest.raises(ValueError, match="cannot truncate to 1: the cache holds 0 positions"):
        twin.truncate(1)
    trained(torch.tensor([[1, 5, 6, 7, 8]]), cache, 0)
    twin = cache.fork()
    trained(torch.tensor([[9]]), twin, 5)
    assert cache.pool.free_blocks == 1 and cache.pool.refcount == [2, 1, 1, 0]
    del twin  # a dropped fork gives its pages back
    assert cache.pool.free_blocks == 2 and cache.pool.refcount == [1, 1, 0, 0]


def test_slot_view_states(trained):
    cache = PagedCache(trained.config, num_blocks=4, block_size=4)
    trained(torch.tensor([[1, 5, 6, 7, 8, 9]]), cache, 0)
    cache.truncate(5)
    view = cache.inspect.slot_view()
    assert view.states == [FILLED] * 5 + [STALE] + [FREE] * 2 + [FREE] * 8  # slots 6, 7 were never written
    assert view.positions == [0, 1, 2, 3, 4] + [-1] * 11 and view.sharers == [1] * 5 + [0] * 11
    assert view.layout == PagedLayout(block_size=4, block_table=[0, 1], block_tables=[[0, 1]], free_blocks=2)
    twin = cache.fork()
    assert twin.inspect.slot_view().states == [SHARED] * 5 + [STALE] + [FREE] * 2 + [FREE] * 8
    assert twin.inspect.slot_view().sharers == [2] * 5 + [0] * 11
    trained(torch.tensor([[20]]), twin, 5)  # copy-on-write: twin moves to page 2
    view = twin.inspect.slot_view()
    assert view.states == [SHARED] * 4 + [FILLED] * 4 + [FILLED] * 2 + [FREE] * 2 + [FREE] * 4
    assert view.positions == [0, 1, 2, 3] + [-1] * 4 + [4, 5, -1, -1] + [-1] * 4  # page 1: the original's only
    assert view.sharers == [2] * 4 + [1] * 4 + [1, 1, 0, 0] + [0] * 4
    assert view.layout.block_table == [0, 2] and view.layout.free_blocks == 1


def test_memory_figures(trained):
    c = trained.config
    cache = PagedCache(c, 20, block_size=8, dtype=torch.float32)
    page = 2 * c.num_layers * c.num_kv_heads * 8 * c.head_dim * 4
    assert cache.pool.num_blocks == 3 and cache.table.page_bytes == page and cache.inspect.reserved_bytes == 3 * page
    assert cache.inspect.reserved_bytes == sum(t.nbytes for t in (*cache.pool.k, *cache.pool.v))
    assert cache.pool.k[0].shape == (3, c.num_kv_heads, 8, c.head_dim)
    trained(torch.tensor([[1, 5, 6, 7, 8, 9, 10, 11, 12, 13]]), cache, 0)
    r = cache.inspect.memory_report()
    assert (r.length, r.logical_bytes, r.analytic_bytes, r.reserved_bytes) == (10, *[kv_bytes(c, 10)] * 2, 3 * page)
    assert (r.written_bytes, r.copied_bytes, r.frees) == (kv_bytes(c, 10), 0, 0)
    assert (r.allocations, r.allocated_bytes) == (2, 2 * page)
    twin = cache.fork()
    # each fork reports the whole shared pool
    assert twin.inspect.reserved_bytes == cache.inspect.reserved_bytes == 3 * page
    assert cache.table.bytes_in_use == 2 * page
    assert twin.inspect.used_bytes == kv_bytes(c, 10)
    trained(torch.tensor([[20]]), twin, 10)
    assert cache.table.bytes_in_use == 3 * page
    assert twin.inspect.memory_report().copied_bytes == kv_bytes(c, 2)


def test_clone_is_independent(trained):
    cache = PagedCache(trained.config, num_blocks=4, block_size=4)
    trained(torch.tensor([[1, 5, 6, 7, 8, 9]]), cache, 0)
    twin = cache.fork()
    copy = cache.clone()
    assert copy.pool is not cache.pool and copy.pool.k[0].data_ptr() != cache.pool.k[0].data_ptr()
    assert copy.block_tables == [[0, 1]] and copy.pool.refcount == [1, 1, 0, 0] and copy.pool.free_blocks == 2
    before = pools(cache)
    trained(torch.tensor([[20, 21, 22]]), copy, 6)
    assert copy.pool.free_blocks == 1 and cache.pool.free_blocks == 2 and twin.length == cache.length == 6
    assert all(torch.equal(a, b) for a, b in zip(pools(cache), before))


def test_constructor_errors_and_batches(tiny):
    with pytest.raises(ValueError, match="PagedCache needs max_seq_len or num_blocks"):
        PagedCache(tiny.config)
    with pytest.raises(ValueError, match="block_size must be at least 1, got 0"):
        PagedCache(tiny.config, 8, block_size=0)
    with pytest.raises(ValueError, match="cannot fork an empty PagedCache"):
        PagedCache(tiny.config, 8).fork()
    cache = PagedCache(tiny.config, 6, batch_size=2, block_size=4)
    assert cache.pool.num_blocks == 4 and cache.capacity == 6
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    both = torch.cat([tiny(ids[:, :3], cache, 0), tiny(ids[:, 3:4], cache, 3), tiny(ids[:, 4:], cache, 4)], 1)
    assert cache.block_tables == [[0, 2], [1, 3]] and cache.pool.free_blocks == 0
    for b in range(2):
        assert torch.allclose(both[b], no_cache_logits(tiny, ids[b:b + 1], batched=True)[0], atol=1e-5)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["step", "step", "step", "rewind", "fork", "drop"]), max_size=30),
       block_size=st.sampled_from([1, 3, 4]))
def test_random_steps_rewinds_and_forks_keep_the_pool_consistent(tiny, ops, block_size):
    gens = [Generator(tiny, PagedCache(tiny.config, num_blocks=60, block_size=block_size))]
    gens[0].prefill([1, 5, 6, 7, 8])
    for i, op in enumerate(ops):
        gen = gens[i % len(gens)]
        if op == "step":
            gen.step()
        elif op == "rewind" and len(gen.history) > 1:
            gen.rewind(min(3, len(gen.history) - 1))
        elif op == "fork":
            gens.append(gen.fork())
        elif op == "drop" and len(gens) > 1:
            gens.remove(gen)
            gen = None  # the last reference: the dropped fork's pages go back to the pool
        pool = gens[0].cache.pool
        held = [p for g in gens for t in g.cache.block_tables for p in t]
        assert pool.refcount == [held.count(p) for p in range(pool.num_blocks)]  # one reference per table entry
        assert sorted(pool.free) == [p for p in range(pool.num_blocks) if p not in held]
    for gen in gens:  # every sequence, shared pages or not, continues exactly as a fresh recomputation
        gen.run(3, stop_at_eos=False)
        ref = Generator(tiny, NoCache(tiny.config))
        ref.prefill(gen.prompt_tokens)
        ref.run(len(gen.history) - 1, stop_at_eos=False)
        assert gen.tokens == ref.tokens
