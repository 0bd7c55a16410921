"""NVIDIA Dynamo's KV router events, read from ai-dynamo/dynamo ``lib/kv-router/src/protocols.rs`` (commit
038eab23; earlier ``lib/llm/src/kv_router/protocols.rs``), as serde writes them to JSON: one ``RouterEvent`` per line,
``{"worker_id", "storage_tier", "event": {"event_id", "data", "dp_rank"}}`` (``storage_tier`` and ``dp_rank`` default
to ``device`` and 0), the data externally tagged in snake case: ``{"stored": {"parent_hash", "start_position",
"blocks": [{"block_hash", "tokens_hash", "mm_extra_info"}]}}``, ``{"removed": {"block_hashes": [...]}}`` or
``"cleared"``. A bare ``KvCacheEvent`` (no worker wrapper) reads too. Hashes are u64: ``block_hash`` the engine's
sequence hash (the chain), ``tokens_hash`` Dynamo's XXH3 of the block's tokens alone.

Mapped: ``event_id`` is the batch's sequence number (one event a batch), ``dp_rank`` its rank, ``storage_tier`` its
medium (``device`` GPU, ``host_pinned`` CPU, ``disk`` STORAGE, ``external`` EXTERNAL). Dynamo sends no token ids, no
block size and no timestamp: blocks are drawn without tokens or text (``Stored.extra["no_token_ids"]`` says so and
``tokens_hash`` is kept in ``extra``), the block size is the one given (``read_kv_events(..., block_size=N)``, else 0:
positions then count blocks), and every batch's ts is 0. One stream is one worker's: a second ``worker_id`` is an
error (split the file by worker_id)."""

from __future__ import annotations

from typing import Any

from ....core.settings import shown
from ..schema import NO_TOKENS, Batch, Cleared, KVEventFormatError, Removed, Stored, read_hash
from .common import Context

HINT = ("Dynamo's RouterEvent (ai-dynamo/dynamo lib/kv-router/src/protocols.rs): {worker_id, storage_tier, event: "
        "{event_id, data: {stored: {parent_hash, blocks: [{block_hash, tokens_hash}]}} | {removed: {block_hashes}} | "
        "\"cleared\", dp_rank}}")
TIERS = {"device": "GPU", "host_pinned": "CPU", "disk": "STORAGE", "external": "EXTERNAL"}
WHY = "Dynamo sends a hash of each block's tokens (tokens_hash), not the token ids"


def detect(obj: Any) -> bool:
    """Dynamo's for sure: a RouterEvent (a map with ``event`` holding ``event_id``) or a bare KvCacheEvent."""
    if not isinstance(obj, dict):
        return False
    inner = obj.get("event")
    return (isinstance(inner, dict) and "event_id" in inner) or ("event_id" in obj and "data" in obj)


def read(obj: Any, where: str, ctx: Context) -> tuple[Batch, int | None]:
    if not isinstance(obj, dict):
        raise KVEventFormatError(f"{where}: a Dynamo KV event is a map (one RouterEvent per JSON line), got "
                                 f"{shown(obj)}; expected {HINT}")
    event = obj["event"] if "event" in obj else obj
    worker = obj.get("worker_id") if "event" in obj else None
    if worker is not None:
        first = ctx.memory.setdefault("worker_id", worker)
        if worker != first:
            raise KVEventFormatError(f"{where}: worker_id {shown(worker)}, but this stream began with worker "
                                     f"{shown(first)}: kvexplore replays one worker's cache a stream; split the file "
                                     f"by worker_id and read each part")
    tier = obj.get("storage_tier", "device")
    if tier not in TIERS:
        raise KVEventFormatError(f"{where}: storage_tier is {shown(tier)}, expected one of {', '.join(TIERS)}")
    if not isinstance(event, dict):
        raise KVEventFormatError(f"{where}: event is {shown(event)}, expected a map; expected {HINT}")
    if missing := [k for k in ("event_id", "data") if k not in event]:
        raise KVEventFormatError(f"{where}: the event lacks {', '.join(missing)}; expected {HINT}")
    seq, rank = event["event_id"], event.get("dp_rank", 0)
    for name, value in (("event_id", seq), ("dp_rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise KVEventFormatError(f"{where}: {name} is {shown(value)}, expected an integer >= 0")
    medium = TIERS[tier]
    ev = _data(event["data"], f"{where}, event_id {seq}", medium, ctx, {"event_id": seq, "worker_id": worker})
    return Batch(0.0, (ev,), rank, (), "map"), seq


def _data(data: Any, where: str, medium: str, ctx: Context, ids: dict[str, Any]) -> Stored | Removed | Cleared:
    if data == "cleared" or (isinstance(data, dict) and list(data) == ["cleared"]):
        return Cleared()
    if not isinstance(data, dict) or len(data) != 1 or next(iter(data)) not in ("stored", "removed"):
        raise KVEventFormatError(f"{where}: data is {shown(data)}, expected {{\"stored\": ...}}, {{\"removed\": ...}} "
                                 f"or \"cleared\" (serde's snake_case tags)")
    (tag, body), = data.items()
    if not isinstance(body, dict):
        raise KVEventFormatError(f"{where}: {tag} is {shown(body)}, expected a map")
    if tag == "removed":
        hashes = body.get("block_hashes")
        if not isinstance(hashes, list):
            raise KVEventFormatError(f"{where}: removed.block_hashes is {shown(hashes)}, expected a list of u64 "
                                     f"block hashes")
        return Removed(tuple(read_hash(h, f"{where}: removed.block_hashes[{i}]", True) for i, h in enumerate(hashes)),
                       medium)
    blocks = body.get("blocks")
    if not isinstance(blocks, list):
        raise KVEventFormatError(f"{where}: stored.blocks is {shown(blocks)}, expected a list of {{block_hash, "
                                 f"tokens_hash}}")
    hashes, tokens_hashes = [], []
    for i, b in enumerate(blocks):
        if not isinstance(b, dict) or "block_hash" not in b:
            raise KVEventFormatError(f"{where}: stored.blocks[{i}] is {shown(b)}, expected a map with block_hash and "
                                     f"tokens_hash")
        hashes.append(read_hash(b["block_hash"], f"{where}: stored.blocks[{i}].block_hash", True))
        tokens_hashes.append(b.get("tokens_hash"))
    parent = body.get("parent_hash")
    parent = None if parent is None else read_hash(parent, f"{where}: stored.parent_hash", True)
    extra = {NO_TOKENS: WHY, "tokens_hash": tokens_hashes, **{k: v for k, v in ids.items() if v is not None}}
    if body.get("start_position") is not None:
        extra["start_position"] = body["start_position"]
    mm = [b.get("mm_extra_info") for b in blocks]
    if any(m is not None for m in mm):
        extra["mm_extra_info"] = mm
    return Stored(tuple(hashes), parent, (), ctx.block_size or 0, medium, 0, None, extra)
