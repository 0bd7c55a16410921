"""A serving engine's KV cache events (vLLM's schema) replayed into prefix-cache frames: both wire forms, bytes and
int hashes, stores of several blocks, removals, clears, data-parallel ranks, media and groups, gaps, bad payloads,
files, a live ZMQ stream with a missed batch recovered through the replay socket, and streams that vLLM's own KV
cache manager and encoder produced (tests/data/vllm_kv_events, see its README)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import msgspec
import pytest

from kvexplore.errors import CorruptFileError, MissingFileError, SettingsError
from kvexplore.prefix.events import (KVEventFormatError, KVEventReplay, KVEventSubscriber, decode_payload,
                                     rank_endpoint, read_kv_events, read_recording, record, save_kv_events)
from kvexplore.prefix.events.schema import hash_hex, parse_text_hash
from kvexplore.prefix.frames import EVICTED, FREE, HELD, WRITTEN, PoolFrame

DATA = Path(__file__).parent / "data" / "vllm_kv_events"
H = [bytes([i]) * 32 for i in range(16)]  # sha256-sized hashes: H[i].hex() starts with i twice


def stored(hashes, parent, tokens, bs=4, **kw):
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": bs, "lora_id": None, "medium": "GPU", "lora_name": None, **kw}


def removed(hashes, **kw):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", **kw}


def batch(*events, ts=1.0, rank=0):
    return {"ts": ts, "events": list(events), "data_parallel_rank": rank}


def pack(b) -> bytes:
    return msgspec.msgpack.encode(b)


def stored_now(frame: PoolFrame) -> dict[str, tuple[int, ...]]:
    return {b.hash: b.tokens for b in frame.blocks if b.state in (WRITTEN, HELD)}


# decoding -----------------------------------------------------------------------------------------------------------
def test_map_array_and_mixed_forms_decode_alike():
    m = batch(stored(H[:2], None, range(8)), removed([H[5]], group_idx=1), {"type": "AllBlocksCleared"}, rank=3)
    arr = [1.0, [["BlockStored", H[:2], None, list(range(8)), 4, None, "GPU", None],
                 ["BlockRemoved", [H[5]], "GPU", 1], ["AllBlocksCleared"]], 3]
    mixed = [1.0, m["events"], 3]  # vLLM 0.34: an array batch of map events
    a, b, c = (decode_payload(pack(x)) for x in (m, arr, mixed))
    assert a.events == b.events == c.events and a.rank == b.rank == c.rank == 3
    assert (a.form, b.form, c.form) == ("map", "array", "array batch, map events")
    st, rm, _ = a.events
    assert st.hashes == tuple(H[:2]) and st.tokens == tuple(range(8)) and st.parent is None and st.block_size == 4
    assert (rm.hashes, rm.medium, rm.group) == ((H[5],), "GPU", 1)
    # vLLM 0.9: no medium (None reads as GPU), int hashes, no rank
    old = decode_payload(pack([2.0, [["BlockStored", [7, -5], 3, list(range(8)), 4, None], ["BlockRemoved", [7]]]]))
    assert old.rank is None and old.events[0].medium == "GPU" and old.events[0].hashes == (7, -5)


def test_hashes_shown_as_short_hex_and_kept_whole():
    assert hash_hex(H[10]) == "0a" * 32 and hash_hex(255) == "ff" and hash_hex(-1) == "f" * 16
    assert parse_text_hash("0a0b") == b"\n\x0b" and parse_text_hash("0x0a0b") == b"\n\x0b"
    assert parse_text_hash("CgsM") == b"\n\x0b\x0c"  # base64, as msgspec's JSON writes bytes
    r = KVEventReplay()
    r.feed(batch(stored([H[1], 0xABCDEF0123456789], None, range(8))))
    frame = r.frames()[1]
    assert [b.hash for b in frame.blocks] == ["01010101", "abcdef01"]
    assert r.full_hash("01010101") == H[1] and r.full_hash("abcdef01") == 0xABCDEF0123456789
    # two hashes sharing their first 8 hex digits get longer names, each naming one hash
    r.feed(batch(stored([0xABCDEF01FFFF0000], None, range(4))))
    assert {b.hash for b in r.frames()[2].blocks} == {"01010101", "abcdef01", "abcdef01ff"}


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


@pytest.mark.parametrize("payload, message", [
    (b"\xc1\xc1garbage", r"batch 0: not a msgpack payload .*is this the event publisher's endpoint"),
    (pack(7), r"a KV event batch is a map or an array, got 7"),
    (pack({"ts": 1.0}), r"a KV event batch map needs ts and events, this one lacks events"),
    (pack([1.0, [], 0, 4, 5]), r"a KV event batch array is \[ts, events\] or .* this one has 5 items"),
    (pack({"ts": "now", "events": []}), r"ts is 'now', expected a number"),
    (pack(batch({"block_hashes": [1]})), r"event 0: the event's type is None, expected one of BlockStored"),
    (pack(batch(stored([H[1]], None, range(4), bs=0))), r"event 0 \(BlockStored\): block_size is 0, expected a "
                                                         r"positive integer"),
    (pack(batch({"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1]})),
     r"event 0 \(BlockStored\): lacks block_size"),
    (pack(batch(stored([1.5], None, range(4)))), r"block_hashes\[0\] is 1.5, expected a block hash \(bytes or an int\)"),
    (pack(batch(stored([1], None, ["a"]))), r"token_ids is \['a'\], expected a list of token ids"),
    (pack(batch(removed([1], medium=3))), r"medium is 3, expected a name"),
    (pack([1.0, [["BlockRemoved", [1], "GPU", 0, None, None, "x"]]]), r"BlockRemoved has 6 fields, .* has 5"),
])
def test_bad_payloads_raise_clear_errors_and_change_nothing(payload, message):
    r = KVEventReplay()
    r.feed(batch(stored([H[1]], None, range(4))))
    with pytest.raises(KVEventFormatError, match=message) as e:
        r.feed(payload, where="batch 0")
    assert isinstance(e.value, CorruptFileError) and isinstance(e.value, ValueError)
    assert len(r.history) == 1 and set(r.state().blocks) == {H[1]}


def test_text_of_blocks_comes_from_a_tokenizer():
    class Letters:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

    r = KVEventReplay().feed_all([batch(stored(H[1:3], None, [1, 2, 3, 4, 5, 6, 7, 8]))])
    f1 = r.frames(tokenizer=Letters())[1]
    assert [b.text for b in f1.blocks] == ["abcd", "efgh"] and [n.text for n in f1.tree] == ["abcd", "efgh"]
    assert [b.text for b in r.frames()[1].blocks] == ["", ""]


# files --------------------------------------------------------------------------------------------------------------
def _sample() -> KVEventReplay:
    r = KVEventReplay()
    r.feed(batch(stored(H[1:4], None, range(12), extra_keys=[None] * 3), ts=10.0), seq=0)
    r.feed(batch(stored([7, 8], None, range(8)), ts=10.5, rank=1), seq=0)
    r.feed(batch(removed([H[3]]), stored([H[4]], H[2], range(50, 54)), ts=11.0), seq=2)
    r.feed(batch({"type": "AllBlocksCleared"}, ts=12.0, rank=1), seq=1)
    return r


def _frames(r: KVEventReplay) -> list:
    return [[f.to_dict() for f in r.frames(rank=k[0], medium=k[1], group=k[2])] for k in r.caches()]


@pytest.mark.parametrize("form", ["jsonl", "recording"])
def test_files_round_trip(tmp_path, form):
    r = _sample()
    path = save_kv_events(r, tmp_path / f"events.{form}", format=form)
    back = read_kv_events(path)
    assert _frames(back) == _frames(r) and back.caches() == r.caches()
    assert [(x.seq, x.rank) for x in back.history] == [(0, 0), (0, 1), (2, 0), (1, 1)]
    assert back.frames()[2].notes[0].startswith("batch with seq 1 missing")


def test_json_lines_in_either_form_and_a_json_list(tmp_path):
    lines = [json.dumps({"seq": 0, "ts": 1.0, "events": [stored([H[1].hex()], None, range(4))]}),
             "", json.dumps([2.0, [["BlockStored", [H[2].hex()], H[1].hex(), [4, 5, 6, 7], 4, None]], 0])]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    r = read_kv_events(tmp_path / "a.jsonl")
    assert stored_now(r.frames()[-1]) == {"01010101": (0, 1, 2, 3), "02020202": (4, 5, 6, 7)}
    (tmp_path / "b.json").write_text(json.dumps([json.loads(lines[0]), json.loads(lines[2])], indent=1))
    assert _frames(read_kv_events(tmp_path / "b.json")) == _frames(r)


def test_bad_files_say_what_is_wrong(tmp_path):
    with pytest.raises(MissingFileError, match="no such KV event file"):
        read_kv_events(tmp_path / "nothing.kvev")
    (tmp_path / "bin").write_bytes(b"\x00\xff\x10binary")
    with pytest.raises(KVEventFormatError, match="neither a kvexplore KV event recording .* nor JSON lines"):
        read_kv_events(tmp_path / "bin")
    (tmp_path / "bad.jsonl").write_text(json.dumps(batch()) + "\n{oops\n")
    with pytest.raises(KVEventFormatError, match=r"bad.jsonl, line 2: not JSON"):
        read_kv_events(tmp_path / "bad.jsonl")
    (tmp_path / "hash.jsonl").write_text(json.dumps(batch(stored(["xyz!"], None, range(4)))) + "\n")
    with pytest.raises(KVEventFormatError, match=r"line 1, event 0 \(BlockStored\): block_hashes\[0\] is 'xyz!', "
                                                 r"expected a block hash as hex"):
        read_kv_events(tmp_path / "hash.jsonl")
    # a recording cut mid-record: an error naming the record and the byte, or the whole records on request
    path = save_kv_events(_sample(), tmp_path / "cut.kvev", format="recording")
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(KVEventFormatError, match=r"record 3 at byte \d+ is cut short .* the first 3 records are whole"):
        read_kv_events(path)
    assert len(read_kv_events(path, allow_truncated=True).history) == 3
    assert [seq for seq, _, _ in read_recording(path, allow_truncated=True)] == [0, 0, 2]


# vLLM's own streams (tests/data/vllm_kv_events, made by make.py with vLLM's KV cache manager) --------------------------
EXPECTED = json.loads((DATA / "expected.json").read_text())


def _key(h):
    return h.hex() if isinstance(h, bytes) else h


@pytest.mark.parametrize("name, form, groups", [
    ("vllm034_bytes.kvev", "bytes", (0, 1)), ("vllm034_bytes_base64.jsonl", "bytes", (0, 1)),
    ("live_vllm034.kvev", "bytes", (0, 1)), ("vllm034_int.jsonl", "int", (0, 1)), ("vllm092_array.kvev", "int", (0,)),
])
def test_vllm_streams_replay_into_the_blocks_the_engine_cached(name, form, groups):
    r = read_kv_events(DATA / name)
    expected = EXPECTED["streams"][form]
    for rank in (0, 1):
        want = expected[str(rank)]
        for g in groups:
            if rank == 0 and g == 1:
                continue
            frames = r.frames(rank=rank, group=g)
            assert len(frames) == len(want["cached"]) + 1
            for frame, cached in zip(frames[1:], want["cached"]):
                # the replayed blocks are exactly the engine's cached blocks of that group after that step
                shown = sorted(_key(r.full_hash(b.hash)) for b in frame.blocks if b.state in (WRITTEN, HELD))
                assert shown == sorted(h for gg, h in cached if gg == g), (name, rank, g, frame.index)
                for b in frame.blocks:
                    if b.state in (WRITTEN, HELD):
                        assert list(b.tokens) == want["tokens"][str(_key(r.full_hash(b.hash)))]
                assert {n.id for n in frame.tree if n.state != EVICTED} == set(stored_now(frame))
    assert r.frames(rank=0)[-1].block_size == EXPECTED["block_size"] == 4


def test_vllm_stream_tells_evictions_and_the_reset():
    r = read_kv_events(DATA / "vllm034_bytes.kvev")
    notes = [f.notes for f in r.frames(rank=0)]
    assert any(n.startswith("removed ") for n in notes[3])  # the long request evicted cached blocks
    assert notes[5][0].startswith("all blocks cleared")      # reset_prefix_cache
    hybrid = r.frames(rank=1)[1]
    assert "group 0" in hybrid.title and r.frames(rank=1, group=1)[1].meta["group"] == 1


# live: a ZMQ publisher that behaves as vLLM's ZmqEventPublisher ---------------------------------------------------
class Publisher:
    """vLLM's ZmqEventPublisher's wire behaviour (vllm/distributed/kv_events.py, 0.34): PUB (topic, seq, payload);
    a ROUTER answering (b"", start) with (b"", topic, seq, payload) per buffered batch, then seq -1. ``drop``: seqs
    buffered but not published (lost on the way). An XPUB socket (a PUB that also hears subscriptions), so that the
    test publishes once the subscriber is listening."""

    def __init__(self, zmq, ctx, topic=b"kv", drop=()):
        self.zmq, self.topic, self.drop, self.buffer = zmq, topic, set(drop), []
        self.pub = ctx.socket(zmq.XPUB)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.requests, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def wait_for_subscriber(self):
        assert self.pub.poll(10_000), "no subscriber within 10 s"
        self.pub.recv()  # the subscription message

    def publish(self, seq, b):
        payload = pack(b)
        self.buffer.append((seq, payload))
        if seq not in self.drop:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def _serve(self):
        while not self._stop.is_set():
            if self.router.poll(20):
                client, _, start = self.router.recv_multipart()
                start = int.from_bytes(start, "big")
                self.requests.append(start)
                for seq, payload in self.buffer:
                    if seq >= start:
                        self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
                self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.pub.close(0)
        self.router.close(0)


BATCHES = [batch(stored(H[1:3], None, range(8))), batch(stored([H[3]], H[2], range(8, 12))),
           batch(removed([H[1]])), batch(stored([H[4]], H[3], range(12, 16))), batch({"type": "AllBlocksCleared"}),
           batch(stored([H[5]], None, range(4)))]


def test_live_stream_with_a_missed_batch_recovered_through_replay(tmp_path):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    with Publisher(zmq, ctx, drop={3}) as pub:
        written = []
        sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}", topic="kv",
                                sink=lambda seq, payload, rank: written.append(seq))
        pub.wait_for_subscriber()
        for seq, b in enumerate(BATCHES):
            pub.publish(seq, b)
        replay = sub.collect(duration_s=10, max_batches=len(BATCHES))
        sub.close()
    ctx.term()
    assert [x.seq for x in replay.history] == [0, 1, 2, 3, 4, 5] and written == [0, 1, 2, 3, 4, 5]
    assert sub.recovered == 1 and pub.requests == [3] and all(x.gap is None for x in replay.history)
    want = KVEventReplay().feed_all(BATCHES)
    assert [f.to_dict() for f in replay.frames()] == [f.to_dict() for f in want.frames()]
    assert stored_now(replay.frames()[4]) == {"02020202": (4, 5, 6, 7), "03030303": (8, 9, 10, 11),
                                              "04040404": (12, 13, 14, 15)}


def test_record_catches_up_then_a_silent_replay_socket_leaves_the_gap_told(tmp_path):
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    with Publisher(zmq, ctx) as pub:
        for seq, b in enumerate(BATCHES[:2]):  # before anyone listens: only the replay socket has them
            pub.publish(seq, b)
        done = {}
        thread = threading.Thread(target=lambda: done.setdefault("r", record(
            f"tcp://127.0.0.1:{pub.port}", tmp_path / "rec.kvev", seconds=10, max_batches=len(BATCHES),
            replay_endpoint=f"tcp://127.0.0.1:{pub.replay_port}")))
        thread.start()
        pub.wait_for_subscriber()
        for seq, b in enumerate(BATCHES[2:], 2):
            pub.publish(seq, b)
        thread.join()
    ctx.term()
    assert pub.requests == [0] and "2 of the batches came through the replay socket" in done["r"].summary()
    assert done["r"].history == [] and done["r"].stats[0].batches == 6  # a recorder keeps counts, not batches
    with pytest.raises(SettingsError, match=r"keeps no batches .* read_kv_events\(path\).frames\(\)"):
        done["r"].frames()
    back = read_kv_events(tmp_path / "rec.kvev")
    assert [f.to_dict() for f in back.frames()] == [f.to_dict() for f in KVEventReplay().feed_all(BATCHES).frames()]
    # a replay endpoint nobody serves: one request times out, the gap is told in the frame after it
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    with KVEventSubscriber(f"tcp://127.0.0.1:{port}", "tcp://127.0.0.1:1", replay_timeout_s=0.2) as sub:
        assert pub.poll(10_000) and pub.recv() == b"\x01"  # subscribed (to every topic)
        for seq in (0, 2):
            pub.send_multipart([b"", seq.to_bytes(8, "big"), pack(BATCHES[seq])])
        sub.collect(duration_s=5, max_batches=2)
    pub.close(0)
    ctx.term()
    assert "did not answer a replay request within 0.2 s" in sub.replay.notes[0]
    assert sub.replay.frames()[2].notes[0].startswith("batch with seq 1 missing")


def test_endpoints_pyzmq_and_arguments(monkeypatch):
    assert rank_endpoint("tcp://host:5557", 0) == "tcp://host:5557"
    assert rank_endpoint("tcp://host:5557", 2) == "tcp://host:5559"
    assert rank_endpoint("inproc://cache", 1) == "inproc://cache_dp1"
    with pytest.raises(SettingsError, match="pass one endpoint per rank as a list"):
        rank_endpoint("ipc:///tmp/x", 1)
    with pytest.raises(SettingsError, match=r"tcp://\*:5557 is a bind address .* tcp://localhost:5557"):
        KVEventSubscriber("tcp://*:5557")
    with KVEventSubscriber("tcp://127.0.0.1:1") as sub, pytest.raises(SettingsError, match="duration_s or max_batches"):
        sub.collect()
    monkeypatch.setitem(__import__("sys").modules, "zmq", None)
    with pytest.raises(SettingsError, match=r"needs pyzmq: pip install pyzmq"):
        KVEventSubscriber()
    monkeypatch.setitem(__import__("sys").modules, "msgspec", None)
    with pytest.raises(SettingsError, match=r"needs msgspec: pip install msgspec"):
        decode_payload(b"\x90")


def test_cli_show_and_bad_file(tmp_path, capsys):
    from kvexplore.cli import main

    assert main(["kv-events", "show", str(DATA / "vllm034_bytes.kvev")]) == 0
    out = capsys.readouterr().out
    assert "rank 0: 6 batches, seq 0..5, 11 events, no gaps" in out
    assert "GPU group 0: 3 blocks stored now (12 tokens, block size 4)" in out and "cleared 1 time (8 blocks)" in out
    assert "rank 1" in out and "GPU group 1: 8 blocks stored now" in out and "tree depth 4 blocks (16 tokens)" in out
    assert main(["kv-events", "show", "--batches", str(DATA / "vllm092_array.kvev")]) == 0
    assert "all blocks cleared" in capsys.readouterr().out
    (tmp_path / "x.jsonl").write_text("nope\n")
    assert main(["kv-events", "show", str(tmp_path / "x.jsonl")]) == 1
    assert "x.jsonl, line 1: not JSON" in capsys.readouterr().err


def test_cli_records_a_live_stream(tmp_path, capsys):
    import queue

    from kvexplore.cli import main

    zmq = pytest.importorskip("zmq")
    ports, recorded = queue.Queue(), threading.Event()

    def engine():  # its sockets live in this thread only
        ctx = zmq.Context()
        with Publisher(zmq, ctx, topic=b"") as pub:
            ports.put(pub.port)
            pub.wait_for_subscriber()
            for seq, b in enumerate(BATCHES):
                pub.publish(seq, b)
            recorded.wait(30)  # closing at once could drop what is still queued
        ctx.term()

    thread = threading.Thread(target=engine)
    thread.start()
    port = ports.get(timeout=10)
    out = tmp_path / "cli.kvev"
    assert main(["kv-events", "record", f"tcp://127.0.0.1:{port}", "-o", str(out), "--batches", "6",
                 "--seconds", "20"]) == 0
    recorded.set()
    thread.join()
    assert capsys.readouterr().out.startswith(f"6 batches recorded to {out}\nrank 0: 6 batches, seq 0..5")
    assert [f.to_dict() for f in read_kv_events(out).frames()] == \
        [f.to_dict() for f in KVEventReplay().feed_all(BATCHES).frames()]
    assert main(["kv-events", "record", "tcp://127.0.0.1:1", "-o", str(tmp_path / "none.kvev"),
                 "--seconds", "0.2"]) == 1
    assert "nothing arrived from tcp://127.0.0.1:1: is the engine running with --kv-events-config" in \
        capsys.readouterr().out


def test_cli_draws_one_cache_of_a_file_to_a_replay_page(tmp_path, capsys):
    from kvexplore.cli import main

    out = tmp_path / "events.html"
    assert main(["kv-events", "show", str(DATA / "vllm034_bytes.kvev"), "--html", str(out), "--rank", "1",
                 "--group", "1"]) == 0
    assert "batches drawn to" in capsys.readouterr().out
    text = out.read_text()
    assert out.stat().st_size > 1_000_000 and "vllm034_bytes.kvev · KV cache events" in text


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
