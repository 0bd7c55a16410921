"""Other engines' KV cache events read into vLLM's records and frames (SGLang, LMCache, NVIDIA Dynamo, Mooncake: each
payload below is shaped as the engine's published schema says, docs/engine-events.md), the engine told from the
content, bad payloads refused naming the field, and ``kvexplore kv-events check``: the recorded vLLM 0.32 streams
(kvexplore/data/vllm_engine) and planted drifts, each named where first seen."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from kvexplore.prefix.events.recorded import FOLDER
from kvexplore.errors import SettingsError
from kvexplore.prefix.events import KVEventFormatError, KVEventRecorder, KVEventReplay, read_kv_events
from kvexplore.prefix.events.check import DRIFT, INFO, check_batches, check_kv_events
from kvexplore.prefix.events.dialects import detect, engine_name
from kvexplore.prefix.events.schema import NO_TOKENS, Cleared, Removed, Stored
from kvexplore.prefix.events.vllm_hashes import vllm_block_hashes, vllm_chain_hashes
from prefix_events_support import batch, removed, stored, stored_now

ENGINE_DATA = FOLDER


def events_of(replay: KVEventReplay) -> list:
    return [e for rec in replay.history for e in rec.batch.events]


def write_jsonl(path: Path, objs: list) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def write_recording(path: Path, objs: list) -> Path:
    with KVEventRecorder(path) as out:
        for seq, obj in enumerate(objs):
            out.write(seq, msgspec.msgpack.encode(obj))
    return path


# SGLang: array_like structs, [ts, events, attn_dp_rank], HiCache's tier names ----------------------------------------
SGLANG = [1.5, [["BlockStored", [11, 12], None, list(range(8)), 4, None],
                ["BlockStored", [13], 12, [8, 9, 10, 11], 4, None, "CPU_TIER1"],
                ["BlockStored", [14], 13, [12, 13, 14, 15], 4, None, "CPU_TIER2"],
                ["BlockRemoved", [11]], ["BlockRemoved", [13], "CPU_TIER1"], ["AllBlocksCleared"]], 2]


def test_sglang_arrays_read_with_its_rank_and_tiers_renamed(tmp_path):
    replay = read_kv_events(write_recording(tmp_path / "sglang.kvev", [SGLANG]))
    assert replay.engine == "sglang"  # told by CPU_TIER1/CPU_TIER2, which vLLM never sends
    a, b, c, r1, r2, cleared = events_of(replay)
    assert (a.hashes, a.parent, a.tokens, a.block_size, a.medium) == ((11, 12), None, tuple(range(8)), 4, "GPU")
    assert (b.medium, b.extra["engine_medium"]) == ("CPU", "CPU_TIER1")
    assert (c.medium, c.extra["engine_medium"], c.parent) == ("STORAGE", "CPU_TIER2", 13)
    assert r1 == Removed((11,), "GPU", 0) and r2 == Removed((13,), "CPU", 0) and cleared == Cleared()
    assert replay.history[0].rank == 2 and replay.caches() == [(2, "CPU", 0), (2, "GPU", 0), (2, "STORAGE", 0)]


def test_sglang_map_form_names_attn_dp_rank():
    m = {"ts": 2.0, "events": [stored([21], None, range(4), medium=None), removed([21], medium=None)],
         "attn_dp_rank": 1}
    assert detect([m]) == "sglang"
    replay = KVEventReplay(engine="sglang")
    replay.feed(m)
    assert replay.history[0].rank == 1 and stored_now(replay.frames(rank=1)[1]) == {}
    with pytest.raises(KVEventFormatError, match=r"both attn_dp_rank \(SGLang\) and data_parallel_rank \(vLLM\)"):
        replay.feed({**m, "data_parallel_rank": 1})
    with pytest.raises(KVEventFormatError, match=r"event 0 \(BlockStored\): block_size is 0, expected a positive "
                                                 r"integer.*\[read as SGLang's KV event schema"):
        replay.feed([1.0, [["BlockStored", [1], None, [1], 0, None]]])


# LMCache: vLLM's BlockStored, one chunk each, torch device names as media --------------------------------------------
LMCACHE = {"ts": 3.0, "data_parallel_rank": 0, "events": [
    stored([101], None, range(4), medium="cpu"),
    stored([102], 101, [4, 5], bs=2, medium="cuda:0"),  # the prompt's last chunk: short, its block_size its tokens
    stored([103], None, range(4), medium="LocalDiskBackend"),
    stored([104], None, range(4), medium="CXL"),
    removed([101], medium="cpu")]}


def test_lmcache_chunks_read_with_its_media_renamed(tmp_path):
    replay = read_kv_events(write_jsonl(tmp_path / "lmcache.jsonl", [LMCACHE]))
    assert replay.engine == "lmcache"
    a, b, c, d, r = events_of(replay)
    assert [e.medium for e in (a, b, c, d)] == ["CPU", "GPU", "STORAGE", "CXL"]
    assert [e.extra.get("engine_medium") for e in (a, b, c, d)] == ["cpu", "cuda:0", "LocalDiskBackend", None]
    assert (b.block_size, b.tokens, b.parent) == (2, (4, 5), 101) and r == Removed((101,), "CPU", 0)
    assert stored_now(replay.frames(medium="GPU")[1]) == {"66": (4, 5)}


# Dynamo: RouterEvent JSON, one event a line, no token ids ------------------------------------------------------------
def router(event_id, data, tier="device", worker=7, dp_rank=0):
    return {"worker_id": worker, "storage_tier": tier, "event": {"event_id": event_id, "data": data,
                                                                   "dp_rank": dp_rank}}


DYNAMO = [router(0, {"stored": {"parent_hash": None, "blocks": [{"block_hash": 501, "tokens_hash": 9001},
                                                                 {"block_hash": 502, "tokens_hash": 9002}]}}),
          router(1, {"stored": {"parent_hash": 502, "start_position": 2,
                                "blocks": [{"block_hash": 503, "tokens_hash": 9003, "mm_extra_info": None}]}}),
          router(2, {"stored": {"parent_hash": None, "blocks": [{"block_hash": 501, "tokens_hash": 9001}]}},
                 tier="host_pinned"),
          router(4, {"removed": {"block_hashes": [503]}}),
          router(5, "cleared")]


def test_dynamo_router_events_read_without_tokens_and_drawn(tmp_path):
    replay = read_kv_events(write_jsonl(tmp_path / "dynamo.jsonl", DYNAMO), block_size=16)
    assert replay.engine == "dynamo"
    a, b, c, r, cleared = events_of(replay)
    assert (a.hashes, a.parent, a.tokens, a.block_size, a.medium) == ((501, 502), None, (), 16, "GPU")
    assert a.extra == {NO_TOKENS: "Dynamo sends a hash of each block's tokens (tokens_hash), not the token ids",
                       "tokens_hash": [9001, 9002], "event_id": 0, "worker_id": 7}
    assert b.extra["start_position"] == 2 and c.medium == "CPU" and r == Removed((503,), "GPU") and cleared == Cleared()
    assert [rec.seq for rec in replay.history] == [0, 1, 2, 4, 5] and replay.stats[0].gaps == 1  # event_id 3 lost
    frames = replay.frames()
    assert stored_now(frames[2]) == {"1f5": (), "1f6": (), "1f7": ()} and frames[2].block_size == 16
    assert "no token ids (Dynamo sends a hash of each block's tokens (tokens_hash), not the token ids): the blocks " \
           "are drawn without tokens or text" in frames[1].notes
    assert [n.start for n in frames[2].tree] == [0, 16, 32]


def test_dynamo_without_a_block_size_counts_positions_in_blocks():
    replay = KVEventReplay(engine="dynamo")
    replay.feed(DYNAMO[0])
    replay.feed(DYNAMO[1]["event"])  # a bare KvCacheEvent reads too
    assert [n.start for n in replay.frames()[2].tree] == [0, 1, 2] and replay.history[1].seq == 1


@pytest.mark.parametrize("obj, message", [
    (router(9, {"stored": {"parent_hash": None, "blocks": [{"block_hash": 1}]}}, worker=8),
     r"worker_id 8, but this stream began with worker 7: .* split the file by worker_id"),
    (router(9, {"evicted": {}}), r"data is .*expected \{\"stored\": ...\}, \{\"removed\": ...\} or \"cleared\""),
    (router(9, {"stored": {"parent_hash": None, "blocks": [{"tokens_hash": 3}]}}),
     r"stored.blocks\[0\] is .*expected a map with block_hash and tokens_hash"),
    (router(9, {"removed": {"block_hashes": 5}}), r"removed.block_hashes is 5, expected a list of u64 block hashes"),
    (router(9, "cleared", tier="hbm"), r"storage_tier is 'hbm', expected one of device, host_pinned, disk, external"),
    ({"worker_id": 7, "event": {"data": "cleared"}}, r"the event lacks event_id; expected Dynamo's RouterEvent"),
])
def test_bad_dynamo_events_name_the_field(obj, message):
    replay = KVEventReplay(engine="dynamo")
    replay.feed(DYNAMO[0])
    with pytest.raises(KVEventFormatError, match=message):
        replay.feed(obj)


# Mooncake: [ts, events], a block a store, replicas as media ----------------------------------------------------------
MOONCAKE = [[4.0, [["BlockStoreEvent", "key_1", [["memory", "tcp://10.0.0.1:6000"]], "llama2-7b", 4, "0a0b", "",
                    [1, 2, 3, 4]],
                   ["BlockStoreEvent", "key_2", [["memory", "tcp://10.0.0.1:6000"], ["disk", "/d/2.bin"]], "", 4,
                    "0c0d", "0a0b", [5, 6, 7, 8]]]],
            [5.0, [["BlockUpdateEvent", "key_1", [["memory", "tcp://10.0.0.1:6000"], ["local_disk", "tcp://x"]]],
                   ["BlockUpdateEvent", "key_2", []], ["BlockUpdateEvent", "key_9", []]]],
            [6.0, [["RemoveAllEvent"]]]]


def test_mooncake_stores_updates_and_clears(tmp_path):
    replay = read_kv_events(write_recording(tmp_path / "mooncake.kvev", MOONCAKE))
    assert replay.engine == "mooncake"
    a, b_cpu, b_disk, a_disk, gone_cpu, gone_disk, cleared = events_of(replay)
    assert (a.hashes, a.parent, a.tokens, a.block_size, a.medium) == ((b"\n\x0b",), None, (1, 2, 3, 4), 4, "CPU")
    assert a.extra == {"mooncake_key": "key_1", "block_size": 4, "model_name": "llama2-7b"}
    assert (b_cpu.parent, b_cpu.medium, b_disk.medium) == (b"\n\x0b", "CPU", "STORAGE")
    assert a_disk == Stored(a.hashes, None, a.tokens, 4, "STORAGE", 0, None, a.extra)  # reached local_disk
    assert gone_cpu == Removed((b"\x0c\x0d",), "CPU") and gone_disk == Removed((b"\x0c\x0d",), "STORAGE")
    assert cleared == Cleared() and replay.history[1].batch.skipped == ("BlockUpdateEvent of a key never stored",)
    assert stored_now(replay.frames(medium="STORAGE")[2]) == {"0a0b": (1, 2, 3, 4)}


def test_bad_mooncake_events_name_the_field():
    replay = KVEventReplay(engine="mooncake")
    with pytest.raises(KVEventFormatError, match=r"event 0 \(BlockStoreEvent\): has 6 items, lacks "
                                                 r"parent_block_hash, token_ids; expected Mooncake's KV events"):
        replay.feed([1.0, [["BlockStoreEvent", "k", [], "", 4, "0a"]]])
    with pytest.raises(KVEventFormatError, match=r"replicas\[0\] is 'memory', expected \[type, location\]"):
        replay.feed([1.0, [["BlockStoreEvent", "k", ["memory"], "", 4, "0a", "", [1]]]])
    with pytest.raises(KVEventFormatError, match=r"a Mooncake event batch is \[ts, events\], got \{\}"):
        replay.feed({})


# the engine told, or named -------------------------------------------------------------------------------------------
def test_detection_is_sure_or_vllm():
    assert [detect([x]) for x in (SGLANG, LMCACHE, DYNAMO[0], MOONCAKE[0])] == ["sglang", "lmcache", "dynamo",
                                                                                 "mooncake"]
    assert detect([batch(stored([1], None, range(4)))]) == "vllm"  # SGLang without tiers reads the same: vLLM's
    assert detect([[1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None]]]]) == "vllm"
    with pytest.raises(SettingsError, match="engine 'trt': kvexplore reads the KV events of vllm, dynamo, mooncake, "
                                            "sglang, lmcache"):
        engine_name("trt")


def test_a_named_engine_overrides_detection(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [[1.0, [["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "CPU_TIER1"]]]])
    assert events_of(read_kv_events(path, engine="vllm"))[0].medium == "CPU_TIER1"
    assert events_of(read_kv_events(path))[0].medium == "CPU"


# check: the recorded vLLM 0.32 streams -------------------------------------------------------------------------------
@pytest.mark.parametrize("name, codes", [
    ("smollm2-0", {"stored-again": 1, "never-removed": 6}),  # 5 blocks, one held twice
    ("smollm2-1", {"never-removed": 7}),
    ("smollm2-2", {"never-removed": 6}),
])
def test_smollm2_streams_are_clean(name, codes):
    report = check_kv_events(ENGINE_DATA / name / "events.kvev")
    assert report.exit_code == 0 and report.codes() == codes and all(f.level == INFO for f in report.findings)


def test_gemma3_sliding_groups_show_the_known_vllm032_behaviour():
    report = check_kv_events(ENGINE_DATA / "gemma3-2" / "events.kvev")
    assert report.exit_code == 0 and not report.drift
    sliding, = [f for f in report.findings if f.code == "vllm032-sliding-tokens"]
    assert (sliding.level, sliding.count, sliding.first) == (INFO, 15, "batch 1 (seq 0), event 0")
    assert sliding.message.startswith("1504 token ids for 16 blocks of 32 in sliding-window group 0: vLLM 0.32's")
    assert [f.count for f in report.findings if f.code == "never-removed"] == [56] * 5 + [118]  # copies held


# check: planted drifts -----------------------------------------------------------------------------------------------
IDS = list(range(100, 164))
A, B = vllm_block_hashes(IDS, 32)


def test_planted_drifts_are_each_named_where_first_seen():
    good = batch(stored([A], None, IDS[:32], bs=32, group_idx=0))
    report = check_batches([
        good,
        batch(stored([B], A, IDS[32:], bs=32)),                                # no group_idx, the others have it
        batch(stored([b"\x01" * 32], B, IDS[:40], bs=32, group_idx=0)),        # #44451: 40 tokens for one block
        batch(stored([b"\x02" * 32], B, IDS[:32], bs=32, group_idx=0)),        # not the hash of its tokens
        batch(stored([7], None, range(4), group_idx=1), stored([7], None, range(4, 8), group_idx=1)),  # double store
        batch(removed([A], group_idx=0), removed([A], group_idx=0), removed([99], group_idx=1)),  # unknown removals
    ])
    assert report.exit_code == 1
    found = {f.code: (f.level, f.count, f.first) for f in report.findings}
    assert found == {"token-count": (DRIFT, 1, "batch 3 (seq 2), event 0"),
                     "hash-mismatch": (DRIFT, 1, "batch 4 (seq 3), event 0"),
                     "double-store": (DRIFT, 1, "batch 5 (seq 4), event 1"),
                     "unknown-removal": (DRIFT, 2, "batch 6 (seq 5), event 1"),
                     "missing-group_idx": (DRIFT, 1, "batch 2 (seq 1), event 0 (BlockStored)"),
                     "never-removed": (INFO, 2, "")}
    assert [f.message for f in report.findings if f.code == "never-removed"] == [
        "rank 0 GPU group 0: 3 blocks stored and not removed by the end (still cached when the stream stopped)",
        "rank 0 GPU group 1: 2 blocks stored and not removed by the end (still cached when the stream stopped)"]
    text = {f.code: f.message for f in report.findings}
    assert text["token-count"] == "40 token ids for 1 block of 32 (expected 32): token_ids do not match the hashes' " \
                                  "blocks (vLLM issue #44451)"
    assert text["hash-mismatch"] == "block 0 (02020202) is not the sha256_cbor hash of its tokens under its parent"
    assert text["missing-group_idx"].startswith("1 of 9 stores and removals lack group_idx while the others carry it")


def test_planted_array_form_mixed_forms_and_gaps_are_named():
    arr = [1.0, [["BlockStored", [A], None, IDS[:32], 32, None, "GPU", None, None, 0]], 0]
    report = check_batches([(0, None, batch(stored([A], None, IDS[:32], bs=32, group_idx=0))), (1, None, arr),
                            (5, None, batch(removed([A], group_idx=0)))])
    found = {f.code: (f.count, f.first) for f in report.findings}
    assert found["array-events"] == (1, "batch 2 (seq 1), event 0")
    assert found["mixed-forms"] == (1, "batch 2 (seq 1)") and found["seq-gap"] == (1, "batch 3 (seq 5)")
    assert "stored-again" in found and report.exit_code == 1


def test_the_chain_continues_from_a_parent():
    assert vllm_chain_hashes(IDS[32:], 32, A) == [B] and vllm_chain_hashes(IDS, 32, None) == [A, B]


def test_check_says_what_other_engines_lack(tmp_path):
    report = check_kv_events(write_jsonl(tmp_path / "d.jsonl", DYNAMO))
    assert report.engine == "dynamo" and report.codes() == {"seq-gap": 1, "no-token-ids": 3}
    assert check_batches(MOONCAKE).codes() == {"skipped-events": 1}


# the command line ----------------------------------------------------------------------------------------------------
def test_cli_check(tmp_path, capsys):
    from kvexplore.cli import main

    assert main(["kv-events", "check", str(ENGINE_DATA / "gemma3-0" / "events.kvev")]) == 0
    out = capsys.readouterr().out
    assert "gemma3-0/events.kvev: read as vllm, 5 batches, 30 events, 6 caches" in out
    assert "info   vllm032-sliding-tokens: 15x, first at batch 2 (seq 1), event 0:" in out
    assert out.rstrip().endswith("no drift found (information only)")
    bad = write_jsonl(tmp_path / "bad.jsonl", [batch(stored([A.hex()], None, IDS[:40], bs=32))])
    assert main(["kv-events", "check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "drift  token-count: 1x, first at batch 1 (seq 0), event 0: 40 token ids for 1 block of 32" in out
    assert out.rstrip().endswith("1 kind of drift found")
    assert main(["kv-events", "show", "--engine", "dynamo", "--block-size", "16",
                 str(write_jsonl(tmp_path / "d.jsonl", DYNAMO))]) == 0
    assert "GPU group 0: 0 blocks stored now (0 tokens, block size 16)" in capsys.readouterr().out
