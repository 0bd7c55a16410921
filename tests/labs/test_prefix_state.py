"""PrefixPool's readable state (blocks, hashes, tree, refcounts, free queue, frames, events), requests that keep
their pages, and bad input: a clear error, and the pool exactly as it was."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from kvexplore.caches.strategies.paged import PagePoolFullError
from kvexplore.errors import SettingsError
from kvexplore.prefix.frames import CACHED, FREE, HELD, HIT, WRITTEN
from kvexplore.prefix.index import block_hashes, short

BS = 4


def ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def state(pool) -> tuple:
    return (pool.refcounts, pool.free_queue, pool.hashes, len(pool.frames()), len(pool.results),
            [(n.id, n.parent, n.slots) for n in pool.tree])


@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_the_pools_state_reads_as_it_was_built(tiny, policy):
    pool = kvexplore.PrefixPool(tiny, num_blocks=8, block_size=BS, policy=policy)
    a = ids(1, 13)
    r = pool.serve(a, response=[5, 6])  # writes 13 + 1 = 14 positions: pages 0..3, blocks 0..2 cached
    assert r.blocks == [0, 1, 2, 3] and r.cached_blocks == [0, 1, 2]
    chain = block_hashes(a + [5], BS)
    assert pool.hashes == {short(h): page for page, h in enumerate(chain)}
    assert pool.refcounts == [0] * 8
    # the request's pages came back last block first; vLLM 0.32's queue (hash) puts the uncached one in front
    assert pool.free_queue == ([3, 4, 5, 6, 7, 2, 1, 0] if policy == "hash" else [4, 5, 6, 7, 3, 2, 1, 0])
    blocks = pool.blocks
    assert [b.state for b in blocks[:5]] == [CACHED, CACHED, CACHED, FREE, FREE]
    assert blocks[1].tokens == tuple(a[4:8]) and blocks[1].hash == short(chain[1])
    assert blocks[1].parent == short(chain[0]) and blocks[0].parent is None and blocks[1].stored_by == 0
    tree = pool.tree
    if policy == "hash":
        assert [(n.parent, n.slots, n.start) for n in tree] == [
            (None, (0,), 0), (short(chain[0]), (1,), 4), (short(chain[1]), (2,), 8)]
    else:
        assert [(n.parent, n.slots, n.start) for n in tree] == [(None, (0, 1, 2), 0)]
        assert tree[0].tokens == tuple(a[:12])
    frame = pool.frames()[1]
    assert [b.state for b in frame.blocks[:5]] == [WRITTEN] * 4 + [FREE]
    assert frame.request.hit_tokens == 0 and frame.request.misses[0].kind == "first-seen"
    again = pool.serve(a, response=[5])
    assert again.hit_tokens == 12 and again.hit_blocks == [0, 1, 2]
    front = 3 if policy == "hash" else 4
    assert again.blocks == [0, 1, 2, front]  # position 12's page: the free queue's front
    assert [b.state for b in pool.frames()[2].blocks[:5]] == [HIT, HIT, HIT] + (
        [WRITTEN, FREE] if front == 3 else [FREE, WRITTEN])
    assert pool.blocks[0].refcount == 0 and pool.frames()[2].blocks[0].last_used == 1


def test_a_kept_request_holds_its_pages_and_shares_them(tiny):
    pool = kvexplore.PrefixPool(tiny, num_blocks=8, block_size=BS)
    a = pool.serve(ids(1, 9), response=[5], keep=True)  # pages 0, 1, 2 held
    b = pool.serve(ids(1, 9), response=[5], keep=True)  # hits 0, 1 (refcount 2), takes page 3 for its last block
    assert b.hit_blocks == [0, 1] and pool.refcounts[:4] == [2, 2, 1, 1]
    assert pool.frames()[-1].blocks[2].state == HELD
    # six pages are held or shared: a request needing four new pages does not fit, and says why
    before = state(pool)
    with pytest.raises(PagePoolFullError, match=r"writes 17 positions \(17 prompt tokens .*needs 5 new blocks, and 4 "
                                                r"of the 8 are free or only cached \(4 held by kept requests\).*"
                                                r"pool.finish\(result\): 2 kept"):
        pool.serve(ids(100, 17), response=[5])
    assert state(pool) == before
    pool.finish(a)
    pool.finish(b)
    assert pool.refcounts == [0] * 8 and len(pool.free_queue) == 8
    with pytest.raises(SettingsError, match="holds no pages"):
        pool.finish(a)


def test_the_pools_events_replay_to_its_cached_blocks(tiny):
    # vLLM's queue before 0.32 ("fifo"): C evicts A1, so the events remove blocks too
    pool = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=BS, policy="hash", reuse="fifo")
    for prompt in (ids(1, 9), ids(100, 9), ids(200, 5), ids(1, 9)):
        pool.serve(prompt, response=[5])
    stored: dict[bytes, tuple] = {}
    for batch in pool.kv_events():
        assert set(batch) == {"ts", "events", "data_parallel_rank"}
        for e in batch["events"]:
            if e["type"] == "BlockRemoved":
                for h in e["block_hashes"]:
                    del stored[h]
            else:
                assert e["block_size"] == BS and len(e["token_ids"]) == BS * len(e["block_hashes"])
                parent = e["parent_block_hash"]
                for i, h in enumerate(e["block_hashes"]):
                    stored[h] = (parent, tuple(e["token_ids"][i * BS:(i + 1) * BS]))
                    parent = h
    assert {short(h) for h in stored} == set(pool.hashes)
    removed = [sum(len(e["block_hashes"]) for e in b["events"] if e["type"] == "BlockRemoved")
               for b in pool.kv_events()]
    added = [sum(len(e["block_hashes"]) for e in b["events"] if e["type"] == "BlockStored") for b in pool.kv_events()]
    assert removed == [r.evicted for r in pool.results] == [0, 0, 1, 1]
    assert added == [len(r.cached_blocks) for r in pool.results] == [2, 2, 1, 1]


def test_sampled_answers_follow_the_seed(tiny):
    pool = kvexplore.PrefixPool(tiny, num_blocks=16, block_size=BS)
    a = pool.serve(ids(1, 9), max_new_tokens=6, temperature=1.0, seed=4)
    b = pool.serve(ids(1, 9), max_new_tokens=6, temperature=1.0, seed=4)
    assert a.generated == b.generated and b.hit_tokens == 8


@pytest.mark.parametrize("request_, kwargs, message", [
    ([], {}, "a request is text, a list of token ids or a list of chat messages|the request is empty"),
    ([1, 2, 10_000], {}, r"token id 10000 is outside this model's vocabulary \(0\.\.319\)"),
    (3.5, {}, "a request is text, a list of token ids or a list of chat messages"),
    ([1, 2, 3], {"max_new_tokens": -1}, "max_new_tokens"),
    ([1, 2, 3], {"response": [4, 5], "max_new_tokens": 3}, "more than the response's 2 tokens"),
    ([{"role": "user"}], {}, "each chat message needs a 'role' and a 'content' string"),
    ([1, 2, 3], {"temperature": -1}, "temperature"),
])
def test_bad_requests_are_refused_before_anything_changes(tiny, request_, kwargs, message):
    pool = kvexplore.PrefixPool(tiny, num_blocks=8, block_size=BS)
    pool.serve(ids(1, 9), response=[5])
    before = state(pool)
    with pytest.raises(SettingsError, match=message):
        pool.serve(request_, **kwargs)
    assert state(pool) == before


def test_a_pool_too_small_for_one_request_names_the_fix(tiny):
    pool = kvexplore.PrefixPool(tiny, num_blocks=3, block_size=BS)
    with pytest.raises(PagePoolFullError, match="create the pool with a larger num_blocks"):
        pool.serve(ids(1, 13), max_new_tokens=2)
    assert pool.free_queue == [0, 1, 2] and not pool.results


def test_bad_pools_are_refused(tiny, zoo):
    with pytest.raises(SettingsError, match="policy must be one of"):
        kvexplore.PrefixPool(tiny, num_blocks=8, policy="lru")
    with pytest.raises(SettingsError, match="num_blocks"):
        kvexplore.PrefixPool(tiny, num_blocks=0)
    with pytest.raises(SettingsError, match="checkpoint_states must be one of"):
        kvexplore.PrefixPool(tiny, num_blocks=8, checkpoint_states="never")
    with pytest.raises(SettingsError, match="keeps a compressed latent \\(MLA\\), which it does not page yet"):
        kvexplore.PrefixPool(zoo.load("deepseek_v3"), num_blocks=8)


def test_a_request_that_fails_midway_leaves_the_pool_consistent(tiny, monkeypatch):
    pool = kvexplore.PrefixPool(tiny, num_blocks=8, block_size=BS)
    a = ids(1, 9)
    first = pool.serve(a, max_new_tokens=3, keep_logits=True)
    calls = {"n": 0}
    real = pool.executor.__class__.__call__

    def flaky(self, *args, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("interrupted")
        return real(self, *args, **kw)

    monkeypatch.setattr(pool.executor.__class__, "__call__", flaky)
    with pytest.raises(RuntimeError, match="interrupted"):
        pool.serve(ids(1, 8) + ids(100, 6), max_new_tokens=3)
    monkeypatch.undo()
    assert pool.refcounts == [0] * 8 and sorted(pool.free_queue) == list(range(8))
    assert len(pool.results) == 1 and len(pool.frames()) == 2
    again = pool.serve(a, max_new_tokens=3, keep_logits=True)  # the cached blocks are intact
    assert again.hit_tokens == 8
    torch.testing.assert_close(again.logits, first.logits, atol=1e-5, rtol=0)


def test_a_hash_block_whose_parent_was_evicted_is_unreachable():
    from kvexplore.prefix.hashing import HashIndex
    index = HashIndex(BS)
    a = ids(1, 12)
    chain = block_hashes(a, BS)
    assert index.insert(a, [5, 6, 7], chain) == [5, 6, 7]
    assert index.victim([6, 5, 7]) == 6  # the middle block was at the queue's front
    nodes = index.nodes()
    assert [(n.id, n.reachable) for n in nodes] == [(short(chain[0]), True), (short(chain[2]), False)]
    assert index.match(a, chain) == [5] and index.evictions[0].page == 6 and index.evictions[0].start == 4


def test_a_hash_chain_goes_on_from_the_blocks_already_hashed():
    a = ids(1, 23)
    whole = block_hashes(a, BS)
    assert len(whole) == 5 and block_hashes(a, BS, known=block_hashes(a[:9], BS)) == whole
    assert block_hashes(a, BS, 2, known=whole) == whole[:2]
