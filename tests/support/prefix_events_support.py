"""What the KV event tests share (tests/labs/test_prefix_events_reader.py, tests/labs/test_prefix_events_replay.py and
tests/labs/test_prefix_events_live.py): vLLM's event batches built as an engine sends them, sha256-sized block hashes,
the recorded streams' folder, and the blocks a frame shows stored."""

from __future__ import annotations

from pathlib import Path

import msgspec

from kvexplore.prefix.frames import HELD, WRITTEN, PoolFrame

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_kv_events"
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
