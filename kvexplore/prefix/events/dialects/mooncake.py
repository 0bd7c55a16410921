"""Mooncake Store's KV events, read from kvcache-ai/Mooncake
``docs/source/design/kv-event/mooncake_event_subscriber_guide.md`` (commit 998442c1): msgpack batches ``[ts, events]``
on ZMQ (topic ``mooncake``, vLLM's framing: topic, 8-byte sequence number, payload), each event an array led by its
type: ``["BlockStoreEvent", mooncake_key, replicas, model_name, block_size, block_hash, parent_block_hash,
token_ids]``, ``["BlockUpdateEvent", mooncake_key, replicas]`` (a replica copied, moved or dropped) and
``["RemoveAllEvent"]``. ``replicas`` is a list of ``[type, location]``, the types ``memory``, ``disk`` and
``local_disk``; an unset string field is ``""``.

Mapped: one block a store, its hash the ``block_hash`` text (hex, else base64; an empty one: the key's bytes), its
parent the ``parent_block_hash`` (``""``: none), stored once in each medium its replicas name (``memory`` CPU, ``disk``
and ``local_disk`` STORAGE; none named: CPU). A ``BlockUpdateEvent`` is the difference from the key's last replicas:
removed from the media it left, stored again (same hash, parent, tokens) in those it reached; an update of a key this
stream never showed stored is skipped and listed. ``RemoveAllEvent`` is a clear. The guide gives ``block_size`` as
"Block size in bytes" in one table and "Block size" in the schema: kvexplore takes a block's size as its count of
token ids (``block_size`` itself kept in ``Stored.extra``). Mooncake sends no removal of one block other than a
replica update with no replicas, and no ranks or groups (rank 0, group 0)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ....core.settings import shown
from ..schema import Batch, Cleared, KVEventFormatError, Removed, Stored, parse_text_hash, read_size, read_tokens
from .common import Context, raw_events

HINT = ("Mooncake's KV events (kvcache-ai/Mooncake docs/source/design/kv-event/mooncake_event_subscriber_guide.md): "
        "[ts, [[\"BlockStoreEvent\", key, replicas, model_name, block_size, block_hash, parent_block_hash, token_ids], "
        "[\"BlockUpdateEvent\", key, replicas], [\"RemoveAllEvent\"]]]")
TAGS = {"BlockStoreEvent": 8, "BlockUpdateEvent": 3, "RemoveAllEvent": 1}  # each event's length with its type
NAMES = ("mooncake_key", "replicas", "model_name", "block_size", "block_hash", "parent_block_hash", "token_ids")
MEDIA = {"memory": "CPU", "disk": "STORAGE", "local_disk": "STORAGE"}
DEFAULT = "CPU"


def detect(obj: Any) -> bool:
    """Mooncake's for sure: an event led by one of its type names."""
    return any(isinstance(e, (list, tuple)) and e and e[0] in TAGS for e in raw_events(obj))


def read(obj: Any, where: str, ctx: Context) -> tuple[Batch, int | None]:
    if not isinstance(obj, (list, tuple)) or len(obj) < 2:
        raise KVEventFormatError(f"{where}: a Mooncake event batch is [ts, events], got {shown(obj)}; expected {HINT}")
    ts, events = obj[0], obj[1]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventFormatError(f"{where}: ts is {shown(ts)}, expected a number (seconds since the epoch)")
    if not isinstance(events, (list, tuple)):
        raise KVEventFormatError(f"{where}: events is {shown(events)}, expected a list of events")
    saved = dict(ctx.memory)
    try:
        return _events(ts, events, where, ctx), None
    except KVEventFormatError:
        ctx.memory.clear()
        ctx.memory.update(saved)  # a bad batch changes nothing
        raise


def _events(ts: float, events: list | tuple, where: str, ctx: Context) -> Batch:
    out: list[Stored | Removed | Cleared] = []
    skipped = []
    for i, raw in enumerate(events):
        at = f"{where}, event {i}"
        if not isinstance(raw, (list, tuple)) or not raw or not isinstance(raw[0], str):
            raise KVEventFormatError(f"{at}: a Mooncake event is an array led by its type, got {shown(raw)}")
        tag = raw[0]
        if tag not in TAGS:
            skipped.append(tag)
            continue
        if len(raw) < TAGS[tag]:
            lacks = ", ".join(NAMES[len(raw) - 1:TAGS[tag] - 1])
            raise KVEventFormatError(f"{at} ({tag}): has {len(raw)} items, lacks {lacks}; expected {HINT}")
        if tag == "RemoveAllEvent":
            ctx.memory.clear()
            out.append(Cleared())
        elif tag == "BlockStoreEvent":
            out += _store(raw, f"{at} (BlockStoreEvent)", ctx)
        else:
            done = _update(raw, f"{at} (BlockUpdateEvent)", ctx)
            if done is None:
                skipped.append("BlockUpdateEvent of a key never stored")
            else:
                out += done
    return Batch(float(ts), tuple(out), None, tuple(skipped), "array")


def _media(replicas: Any, where: str) -> list[str]:
    if not isinstance(replicas, (list, tuple)):
        raise KVEventFormatError(f"{where}: replicas is {shown(replicas)}, expected a list of [type, location]")
    media = []
    for i, r in enumerate(replicas):
        if not isinstance(r, (list, tuple)) or len(r) != 2 or not isinstance(r[0], str):
            raise KVEventFormatError(f"{where}: replicas[{i}] is {shown(r)}, expected [type, location] (type memory, "
                                     f"disk or local_disk)")
        m = MEDIA.get(r[0], r[0].upper())
        if m not in media:
            media.append(m)
    return media


def _store(raw: Any, where: str, ctx: Context) -> list[Stored]:
    key, replicas, model, size, block_hash, parent, tokens = raw[1:8]
    if not isinstance(key, str) or not key:
        raise KVEventFormatError(f"{where}: mooncake_key is {shown(key)}, expected the object's key (text)")
    tokens = read_tokens(tokens, where)
    size = read_size(size, where)
    for name, text in (("block_hash", block_hash), ("parent_block_hash", parent)):
        if not isinstance(text, str):
            raise KVEventFormatError(f"{where}: {name} is {shown(text)}, expected text (hex; \"\" when unset)")
    h = parse_text_hash(block_hash, f"{where}: block_hash") if block_hash else key.encode()
    parent = parse_text_hash(parent, f"{where}: parent_block_hash") if parent else None
    extra = {"mooncake_key": key, "block_size": size, **({"model_name": model} if model else {})}
    block = Stored((h,), parent, tokens, len(tokens) or size, DEFAULT, 0, None, extra)
    media = _media(replicas, where) or [DEFAULT]
    ctx.memory[key] = (block, media)
    return [replace(block, medium=m) for m in media]


def _update(raw: Any, where: str, ctx: Context) -> list[Stored | Removed] | None:
    key = raw[1]
    if key not in ctx.memory:
        return None
    block, before = ctx.memory[key]
    after = _media(raw[2], where)
    ctx.memory[key] = (block, after)
    return [Removed(block.hashes, m) for m in before if m not in after] + \
        [replace(block, medium=m) for m in after if m not in before]
