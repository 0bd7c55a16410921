"""vLLM's KV cache event batches (``vllm/distributed/kv_events.py``) read into plain frozen records, in every shape
vLLM has sent them (docs/prefix.md). An event of a type not known here is skipped and listed (``Batch.skipped``): a
newer vLLM may add types. A payload that is not such a batch raises :class:`KVEventFormatError`."""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass, field
from typing import Any

from ...core.settings import shown
from ...errors import CorruptFileError, SettingsError

Hash = bytes | int
DEFAULT_MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: what a store or removal without a medium refers to
KNOWN_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
SCHEMA_HINT = "vLLM's KV event schema as of vLLM 0.34 (vllm/distributed/kv_events.py)"
#: ``Stored.extra`` key set by an engine dialect whose stores carry no token ids (Dynamo: a hash of them only); its
#: value says why, and the blocks are drawn without tokens or text
NO_TOKENS = "no_token_ids"

#: each event's fields in declaration order (the array form lists them so), and how many of them are required
FIELDS = {
    "BlockStored": (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                     "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                     "locality", "ownership", "session_id", "lookahead_token_ids"), 4),
    "BlockRemoved": (("block_hashes", "medium", "group_idx", "locality", "ownership"), 1),
    "AllBlocksCleared": ((), 0),
}
_READ = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
         "group_idx", "type"}
_HEX = re.compile(r"(0x)?[0-9a-fA-F]+")


class KVEventFormatError(CorruptFileError):
    """A payload, a line or a record that is not a vLLM KV event batch (or not a whole one)."""


@dataclass(frozen=True)
class Stored:
    """``BlockStored``: consecutive blocks of one prefix cached; each block's parent is the one before it, the
    first's is ``parent``."""

    hashes: tuple[Hash, ...]
    parent: Hash | None
    tokens: tuple[int, ...]         # len(hashes) * block_size of them, when the engine is consistent
    block_size: int
    medium: str = DEFAULT_MEDIUM
    group: int = 0                  # the KV cache group (hybrid models have several)
    lora: str | None = None         # lora_name, else lora_id as text
    extra: dict[str, Any] = field(default_factory=dict)  # the other fields that were set (extra_keys, spec kind...)


@dataclass(frozen=True)
class Removed:
    """``BlockRemoved``: blocks dropped from the cache (evicted or freed)."""

    hashes: tuple[Hash, ...]
    medium: str = DEFAULT_MEDIUM
    group: int = 0


@dataclass(frozen=True)
class Cleared:
    """``AllBlocksCleared``: every block of the engine's prefix cache dropped (a reset)."""


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class Batch:
    ts: float
    events: tuple[Event, ...]
    rank: int | None = None         # data_parallel_rank (None: the payload did not say)
    skipped: tuple[str, ...] = ()   # the types of events that were skipped, one entry per event
    form: str = "map"               # "map", "array", or "array batch, map events" (vLLM 0.34), ...


def hash_hex(h: Hash) -> str:
    """A block hash as hex: bytes in full; an int as an unsigned 64-bit number when it is a negative one (Python's
    ``hash()``, which vLLM 0.9 used), without leading zeros."""
    if isinstance(h, bytes):
        return h.hex()
    if -(1 << 63) <= h < 0:
        h += 1 << 64
    return format(h, "x") if h >= 0 else "-" + format(-h, "x")


def decode_payload(payload: bytes, where: str = "payload") -> Batch:
    """One msgpack payload (what vLLM's publisher sends as the last frame of a message) -> :class:`Batch`."""
    return read_batch(decode_msgpack(payload, where), where)


def decode_msgpack(payload: bytes, where: str = "payload") -> Any:
    """One msgpack payload decoded to plain lists and maps (any engine's), not yet read as a batch."""
    try:
        import msgspec
    except ImportError as e:
        raise SettingsError("decoding KV events needs msgspec: pip install msgspec (or pip install "
                            "'kvexplore[events]')") from e
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise KVEventFormatError(f"{where}: a KV event payload is bytes (msgpack), got {type(payload).__name__}")
    try:
        return msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise KVEventFormatError(f"{where}: not a msgpack payload ({e}); vLLM's KV event batches are msgpack, "
                                 f"encoded by msgspec: is this the event publisher's endpoint, and the whole "
                                 f"payload?") from e


def read_batch(obj: Any, where: str = "batch", text_hashes: bool = False) -> Batch:
    """A decoded batch (a dict or a list, as msgpack or JSON gives it) -> :class:`Batch`. ``text_hashes``: hashes may
    be hex (or base64) strings, as a JSON file has them."""
    if isinstance(obj, dict):
        form = "map"
        if missing := [k for k in ("ts", "events") if k not in obj]:
            raise KVEventFormatError(f"{where}: a KV event batch map needs ts and events, this one lacks "
                                     f"{', '.join(missing)} (keys: {', '.join(map(str, obj)) or 'none'}); "
                                     f"expected {SCHEMA_HINT}")
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    elif isinstance(obj, (list, tuple)):
        form = "array"
        if not 2 <= len(obj) <= 3:
            raise KVEventFormatError(f"{where}: a KV event batch array is [ts, events] or [ts, events, "
                                     f"data_parallel_rank], this one has {len(obj)} items; expected {SCHEMA_HINT}")
        ts, events, rank = obj[0], obj[1], obj[2] if len(obj) == 3 else None
    else:
        raise KVEventFormatError(f"{where}: a KV event batch is a map or an array, got {shown(obj)}; expected "
                                 f"{SCHEMA_HINT}")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise KVEventFormatError(f"{where}: ts is {shown(ts)}, expected a number (seconds since the epoch)")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise KVEventFormatError(f"{where}: data_parallel_rank is {shown(rank)}, expected a rank (int >= 0) or nil")
    if not isinstance(events, (list, tuple)):
        raise KVEventFormatError(f"{where}: events is {shown(events)}, expected a list of events")
    out, skipped, forms = [], [], set()
    for i, raw in enumerate(events):
        tag, fields, shape = _untag(raw, f"{where}, event {i}")
        forms.add(shape)
        if tag not in FIELDS:
            skipped.append(tag)
            continue
        out.append(_event(tag, fields, f"{where}, event {i} ({tag})", text_hashes))
    if forms and forms != {form}:
        form = f"{form} batch, {'/'.join(sorted(forms))} events"
    return Batch(float(ts), tuple(out), rank, tuple(skipped), form)


def _untag(raw: Any, where: str) -> tuple[str, dict[str, Any], str]:
    if isinstance(raw, dict):
        tag, fields, shape = raw.get("type"), raw, "map"
    elif isinstance(raw, (list, tuple)) and raw:
        tag, shape = raw[0], "array"
        names = FIELDS.get(tag, ((), 0))[0] if isinstance(tag, str) else ()
        if isinstance(tag, str) and len(raw) - 1 > len(names) and tag in FIELDS:
            raise KVEventFormatError(f"{where}: {tag} has {len(raw) - 1} fields, {SCHEMA_HINT} has "
                                     f"{len(names)}: a newer vLLM? its later fields cannot be told apart")
        fields = dict(zip(names, raw[1:]))
    else:
        raise KVEventFormatError(f"{where}: an event is a map with a type or an array led by its type, got "
                                 f"{shown(raw)}")
    if not isinstance(tag, str):
        raise KVEventFormatError(f"{where}: the event's type is {shown(tag)}, expected one of "
                                 f"{', '.join(KNOWN_TAGS)}")
    return tag, fields, shape


def _event(tag: str, f: dict[str, Any], where: str, text_hashes: bool) -> Event:
    names, required = FIELDS[tag]
    if missing := [n for n in names[:required] if n not in f]:
        raise KVEventFormatError(f"{where}: lacks {', '.join(missing)}; expected {SCHEMA_HINT}")
    if tag == "AllBlocksCleared":
        return Cleared()
    listed = f["block_hashes"]
    if not isinstance(listed, (list, tuple)):
        raise KVEventFormatError(f"{where}: block_hashes is {shown(listed)}, expected a list of block hashes")
    hashes = tuple(_hash(h, f"{where}: block_hashes[{i}]", text_hashes) for i, h in enumerate(listed))
    medium = f.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise KVEventFormatError(f"{where}: medium is {shown(medium)}, expected a name (GPU, CPU...) or nil")
    group = f.get("group_idx")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 0):
        raise KVEventFormatError(f"{where}: group_idx is {shown(group)}, expected a group index (int >= 0) or nil")
    medium, group = medium or DEFAULT_MEDIUM, group or 0
    if tag == "BlockRemoved":
        return Removed(hashes, medium, group)
    parent = f["parent_block_hash"]
    parent = None if parent is None else _hash(parent, f"{where}: parent_block_hash", text_hashes)
    tokens = read_tokens(f["token_ids"], where)
    size = read_size(f["block_size"], where)
    lora = f.get("lora_name") or (None if f.get("lora_id") is None else str(f.get("lora_id")))
    extra = {k: v for k, v in f.items() if k not in _READ and v is not None}
    return Stored(hashes, parent, tokens, size, medium, group, lora, extra)


def read_tokens(tokens: Any, where: str, name: str = "token_ids") -> tuple[int, ...]:
    """A list of token ids, checked."""
    if not isinstance(tokens, (list, tuple)) or not all(type(t) is int for t in tokens):
        raise KVEventFormatError(f"{where}: {name} is {shown(tokens)}, expected a list of token ids")
    return tuple(tokens)


def read_size(size: Any, where: str, name: str = "block_size") -> int:
    """A block size (tokens per block), checked."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise KVEventFormatError(f"{where}: {name} is {shown(size)}, expected a positive integer")
    return size


def read_hash(h: Any, where: str, text: bool) -> Hash:
    """One block hash: bytes or an int as they came; hex or base64 text when ``text`` (a JSON file)."""
    return _hash(h, where, text)


def _hash(h: Any, where: str, text: bool) -> Hash:
    if isinstance(h, (bytes, bytearray)):
        return bytes(h)
    if isinstance(h, int) and not isinstance(h, bool):
        return h
    if isinstance(h, str) and text:
        return parse_text_hash(h, where)
    raise KVEventFormatError(f"{where} is {shown(h)}, expected a block hash (bytes or an int"
                             f"{', or a hex string in a JSON file' if text else ''})")


def parse_text_hash(text: str, where: str = "hash") -> bytes:
    """A hash written as text: hex (``0x`` allowed), else base64 (msgspec's JSON form of bytes)."""
    if _HEX.fullmatch(text) and len(text.removeprefix("0x")) % 2 == 0:
        return bytes.fromhex(text.removeprefix("0x"))
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise KVEventFormatError(f"{where} is {shown(text)}, expected a block hash as hex (an even number of "
                                 f"hex digits), base64, or an int") from None
