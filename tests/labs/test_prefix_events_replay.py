"""KV cache events (vLLM's schema) replayed into prefix-cache frames: stores of several blocks, removals that free
slots, clears, removals of unseen blocks, data-parallel ranks, media and groups as separate caches, gaps, duplicates
and restarts, unknown event types, block text from a tokenizer, and a prefix pool's own events replayed into its
blocks."""

from __future__ import annotations

import msgspec
import pytest

from kvexplore.errors import SettingsError
from kvexplore.prefix.events import KVEventReplay
from kvexplore.prefix.frames import EVICTED, FREE, HELD, WRITTEN
from prefix_events_support import H, batch, pack, removed, stored, stored_now


# replaying ----------------------------------------------------------------------------------------------------------
def test_one_event_storing_three_blocks():
    r = KVEventReplay()
    r.feed(pack(batch(stored(H[1:4], None, range(100, 112)))), seq=0)
    f0, f1 = r.frames()
    assert f0.index == 0 and f0.blocks == () and f0.policy == f1.policy == "events" and f1.block_size == 4
    assert [(b.slot, b.state, b.tokens, b.stored_by) for b in f1.blocks] == [
        (0, WRITTEN, (100, 101, 102, 103), 1), (1, WRITTEN, (104, 105, 106, 107), 1),
        (2, WRITTEN, (108, 109, 110, 111), 1)]
    assert [b.parent for b in f1.blocks] == [None, "01010101", "02020202"]
    assert [(n.id, n.parent, n.start, n.reachable, n.slots) for n in f1.tree] == [
        ("01010101", None, 0, True, (0,)), ("02020202", "01010101", 4, True, (1,)),
        ("03030303", "02020202", 8, True, (2,))]
    assert f1.notes == ("stored 3 blocks (12 tokens) as a new prefix (no parent): 01010101, 02020202, 03030303",)
    assert f1.meta["dp_rank"] == 0 and f1.meta["medium"] == "GPU" and f1.meta["seq"] == 0


def test_removal_shows_evicted_then_frees_the_slot_for_the_next_store():
    r = KVEventReplay()
    r.feed(batch(stored(H[1:4], None, range(12))))
    r.feed(batch(removed([H[2]])))
    r.feed(batch(stored([H[4]], H[1], [7, 7, 7, 7]), stored([H[5]], H[1], [8, 8, 8, 8])))
    _, f1, f2, f3 = r.frames()
    assert [b.state for b in f2.blocks] == [HELD, EVICTED, HELD]
    assert f2.blocks[1].hash == "02020202" and f2.blocks[1].tokens == (4, 5, 6, 7) and f2.free_queue == ()
    tree = {n.id: n for n in f2.tree}
    assert tree["x02020202"].state == EVICTED and not tree["03030303"].reachable and tree["01010101"].reachable
    assert f2.notes == ("removed 1 block: 02020202",)
    # the freed slot (1) is taken first, then a new one
    assert [(b.slot, b.state, b.hash) for b in f3.blocks] == [
        (0, HELD, "01010101"), (1, WRITTEN, "04040404"), (2, HELD, "03030303"), (3, WRITTEN, "05050505")]
    assert {n.id: n.start for n in f3.tree}["04040404"] == 4 and f3.num_blocks == 4
    st = r.state()
    assert st.totals["removed"] == 1 and st.totals["stored"] == 5 and set(st.blocks) == {H[1], H[3], H[4], H[5]}


def test_all_blocks_cleared_and_removals_of_unseen_blocks():
    r = KVEventReplay()
    r.feed(batch(stored(H[1:4], None, range(12))))
    r.feed(batch({"type": "AllBlocksCleared"}))
    r.feed(batch(removed([H[9]]), stored([H[6]], H[3], range(4))))
    _, _, f2, f3 = r.frames()
    assert [b.state for b in f2.blocks] == [EVICTED] * 3 and f2.notes == ("all blocks cleared (3 blocks)",)
    assert [b.state for b in f3.blocks] == [WRITTEN, FREE, FREE] and f3.free_queue == (1, 2)
    assert f3.notes[0].startswith("removed 1 block this stream never showed stored (09090909)")  # in event order
    assert f3.notes[1].startswith("stored 1 block (4 tokens) under 03030303, a block this cache does not hold")
    assert [n.reachable for n in f3.tree] == [False]
    assert r.state().totals["cleared"] == 1 and r.state().totals["unknown_removed"] == 1


def test_data_parallel_ranks_media_and_groups_are_separate_caches():
    r = KVEventReplay()
    r.feed(batch(stored([H[1]], None, range(4)), rank=0), seq=0)
    r.feed(batch(stored([H[2]], None, range(4, 8)), rank=1), seq=0)
    r.feed(batch(stored([H[1]], None, range(4), medium="CPU"), stored([H[3]], None, range(8, 12), group_idx=1),
                 rank=1), seq=1)
    r.feed(batch({"type": "AllBlocksCleared"}, rank=0), seq=1)
    assert r.caches() == [(0, "GPU", 0), (1, "CPU", 0), (1, "GPU", 0), (1, "GPU", 1)]
    assert [stored_now(f) for f in r.frames(rank=1)] == [{}, {"02020202": (4, 5, 6, 7)}, {"02020202": (4, 5, 6, 7)}]
    assert r.frames(rank=1)[2].notes == ("nothing changed in GPU group 0 in this batch (it changed CPU group 0, "
                                         "GPU group 1)",)
    assert stored_now(r.frames(rank=1, medium="CPU")[-1]) == {"01010101": (0, 1, 2, 3)}
    assert stored_now(r.frames(rank=1, group=1)[-1]) == {"03030303": (8, 9, 10, 11)}
    assert len(r.frames(rank=0)) == 3 and stored_now(r.frames(rank=0)[-1]) == {}  # rank 1 was not cleared
    assert "this stream also has rank 0 GPU group 0" in r.frames(rank=1)[0].notes[1]
    with pytest.raises(SettingsError, match=r"rank 5 has no KV events in this stream; its ranks: 0, 1"):
        r.frames(rank=5)
    with pytest.raises(SettingsError, match=r"medium 'DISK' has no KV events on rank 1; its media: GPU, CPU"):
        r.frames(rank=1, medium="DISK")


def test_gaps_duplicates_and_restarts_are_told():
    r = KVEventReplay()
    assert r.feed(batch(stored([H[1]], None, range(4))), seq=0)
    assert r.feed(batch(stored([H[2]], H[1], range(4, 8))), seq=1)
    assert not r.feed(batch(stored([H[9]], None, range(4))), seq=1)  # a duplicate: skipped, nothing applied
    assert r.feed(batch(stored([H[3]], H[2], range(8, 12))), seq=4)
    assert r.feed(batch(stored([H[4]], None, range(4))), seq=0)  # the publisher started over
    frames = r.frames()
    assert r.duplicates == 1 and len(frames) == 5 and H[9] not in r.state().blocks
    assert frames[3].notes[0] == ("batches with seq 2..3 missing (a gap in the stream): the blocks they stored or "
                                  "removed are not shown")
    assert frames[4].notes[0].startswith("the publisher started over at seq 0") and "all blocks cleared" in \
        frames[4].notes[1] and stored_now(frames[4]) == {"04040404": (0, 1, 2, 3)}
    assert "rank 0: 4 batches, seq 0..0, 4 events, 2 batches missing in 1 gap, 1 restart" in r.summary()
    assert "1 duplicate batch skipped" in r.summary()


def test_unknown_event_types_are_skipped_with_a_note():
    r = KVEventReplay()
    r.feed(pack(batch({"type": "BlockTouched", "block_hashes": [H[1]]}, stored([H[2]], None, range(4)))))
    f1 = r.frames()[1]
    assert stored_now(f1) == {"02020202": (0, 1, 2, 3)}
    assert f1.notes[-1].startswith("skipped 1 event(s) of a type kvexplore does not read (BlockTouched)")
    assert "vLLM up to 0.34" in f1.notes[-1]


def test_text_of_blocks_comes_from_a_tokenizer():
    class Letters:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

    r = KVEventReplay().feed_all([batch(stored(H[1:3], None, [1, 2, 3, 4, 5, 6, 7, 8]))])
    f1 = r.frames(tokenizer=Letters())[1]
    assert [b.text for b in f1.blocks] == ["abcd", "efgh"] and [n.text for n in f1.tree] == ["abcd", "efgh"]
    assert [b.text for b in r.frames()[1].blocks] == ["", ""]


# a pool's own events --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["hash", "radix"])
def test_a_pools_own_events_replay_into_its_blocks(tiny, policy):
    """The pool tells its history as vLLM does (pool.kv_events()); read back as an engine's stream, every frame's
    stored blocks are the pool's cached blocks after that request, with the same tokens."""
    import kvexplore

    pool = kvexplore.PrefixPool(tiny, num_blocks=6, block_size=4, policy=policy)
    replay = KVEventReplay()
    for prompt in (list(range(1, 10)), list(range(100, 109)), list(range(200, 205)), list(range(1, 10)),
                   list(range(50, 71))):
        pool.serve(prompt, response=[5])
        replay.feed(msgspec.msgpack.encode(pool.kv_events()[-1]))
        stored = replay.frames()[-1]
        held = {b.hash: b.tokens for b in stored.blocks if b.state in (WRITTEN, HELD)}
        cached = {b.hash: b.tokens for b in pool.blocks if b.hash is not None}
        assert held == cached
