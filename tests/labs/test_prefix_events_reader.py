"""Reading a serving engine's KV cache events (vLLM's schema): both wire forms and the mixed one, bytes and int
hashes shown as short hex, bad payloads refused naming what is wrong, files (JSON lines, JSON lists, recordings, cut
recordings), the streams that vLLM's own KV cache manager and encoder produced (tests/data/vllm_kv_events, see its
README) replayed into the blocks the engine cached, and ``kvexplore kv-events show``."""

from __future__ import annotations

import json

import pytest

from kvexplore.errors import CorruptFileError, MissingFileError
from kvexplore.prefix.events import (KVEventFormatError, KVEventReplay, decode_payload, read_kv_events, read_recording,
                                     save_kv_events)
from kvexplore.prefix.events.schema import hash_hex, parse_text_hash
from kvexplore.prefix.frames import EVICTED, HELD, WRITTEN
from prefix_events_support import DATA, H, batch, pack, removed, stored, stored_now


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
    (pack(batch(stored([1.5], None, range(4)))),
     r"block_hashes\[0\] is 1.5, expected a block hash \(bytes or an int\)"),
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


# vLLM's own streams (tests/data/vllm_kv_events, made by make.py with vLLM's KV cache manager) -------------------------
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


# the command line on files --------------------------------------------------------------------------------------------
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


def test_cli_draws_one_cache_of_a_file_to_a_replay_page(tmp_path, capsys):
    from kvexplore.cli import main

    out = tmp_path / "events.html"
    assert main(["kv-events", "show", str(DATA / "vllm034_bytes.kvev"), "--html", str(out), "--rank", "1",
                 "--group", "1"]) == 0
    assert "batches drawn to" in capsys.readouterr().out
    text = out.read_text()
    assert out.stat().st_size > 1_000_000 and "vllm034_bytes.kvev · KV cache events" in text
