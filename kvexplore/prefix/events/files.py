"""KV event streams in files: :func:`read_kv_events` reads a recording or JSON lines (told apart by their first
bytes), :class:`KVEventRecorder` writes a live stream, :func:`save_kv_events` a replay's batches (the formats:
docs/prefix.md)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import MissingFileError, SettingsError
from . import dialects
from .replay import KVEventReplay
from .schema import Batch, Cleared, KVEventFormatError, Removed, Stored, decode_msgpack

MAGIC = b"KVEVREC1"
RECORD = struct.Struct(">qhI")  # seq, rank, payload length


class KVEventRecorder:
    """Appends (seq, rank, payload) records to a new recording; each record is flushed as it is written, so a
    recording stopped at any moment keeps every whole record."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.count = 0
        self._f: BinaryIO | None = open(self.path, "wb")
        self._f.write(MAGIC)
        self._f.flush()

    def write(self, seq: int, payload: bytes, rank: int | None = None) -> None:
        if self._f is None:
            raise SettingsError(f"the recording {self.path} is closed")
        self._f.write(RECORD.pack(seq, -1 if rank is None else rank, len(payload)) + bytes(payload))
        self._f.flush()
        self.count += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> KVEventRecorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_recording(path: str | Path, allow_truncated: bool = False) -> Iterator[tuple[int, int | None, bytes]]:
    """The records of a recording: ``(seq, rank or None, payload)``."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise KVEventFormatError(f"{path}: not a kvexplore KV event recording (it does not start with {MAGIC!r})")
    at, n = len(MAGIC), 0
    while at < len(data):
        end = at + RECORD.size
        if end <= len(data):
            seq, rank, length = RECORD.unpack_from(data, at)
            if end + length <= len(data):
                yield seq, None if rank < 0 else rank, data[end:end + length]
                at, n = end + length, n + 1
                continue
        if allow_truncated:
            return
        raise KVEventFormatError(f"{path}: record {n} at byte {at} is cut short ({len(data) - at} bytes left): the "
                                 f"recording was stopped mid-write or the file was truncated; the first {n} records "
                                 f"are whole: read_kv_events(path, allow_truncated=True) reads them")


def read_kv_events(path: str | Path, allow_truncated: bool = False, engine: str | None = None,
                   block_size: int | None = None) -> KVEventReplay:
    """A file of KV event batches (a recording or JSON lines, told apart by content) replayed. ``engine``: whose
    events they are (``"vllm"``, ``"sglang"``, ``"lmcache"``, ``"dynamo"``, ``"mooncake"``; None: told from the
    content where it is unambiguous, else vLLM: docs/engine-events.md); ``block_size``: the engine's, for one whose
    events do not carry it (Dynamo)."""
    engine = dialects.engine_name(engine)
    if engine is None:
        engine = dialects.detect(obj for _, _, _, obj in raw_batches(path, allow_truncated, decode=True))
    replay = KVEventReplay(engine=engine, block_size=block_size)
    for where, seq, rank, obj in raw_batches(path, allow_truncated):
        replay.feed(obj, seq=seq, rank=rank, where=where)
    return replay


def raw_batches(path: str | Path, allow_truncated: bool = False, decode: bool = False
                ) -> Iterator[tuple[str, int | None, int | None, Any]]:
    """A file's batches as they are in it, not yet read: ``(where, seq, rank, batch)``, the batch a recording's
    msgpack payload (decoded to lists and maps when ``decode``) or a JSON line's value."""
    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path}: no such KV event file")
    with open(path, "rb") as f:
        head = f.read(len(MAGIC))
    if head == MAGIC:
        for seq, rank, payload in read_recording(path, allow_truncated):
            where = f"{path}, seq {seq}"
            yield where, seq, rank, decode_msgpack(payload, where) if decode else payload
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KVEventFormatError(f"{path}: neither a kvexplore KV event recording (it would start with {MAGIC!r}) "
                                 f"nor JSON lines of KV event batches (it is not UTF-8 text)") from None
    for where, obj in _json_batches(path, text):
        seq = obj.pop("seq", None) if isinstance(obj, dict) else None
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int)):
            raise KVEventFormatError(f"{where}: seq is {seq!r}, expected an integer")
        yield where, seq, None, obj


def _json_batches(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    stripped = text.strip()
    if not stripped:
        raise KVEventFormatError(f"{path}: empty; expected KV event batches (a recording, or JSON lines)")
    if stripped.startswith("[") and "\n" in stripped:  # one JSON list of batches, over several lines?
        try:
            whole = json.loads(stripped)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, list) and whole and all(isinstance(b, (dict, list)) for b in whole):
            yield from ((f"{path}, batch {i}", b) for i, b in enumerate(whole))
            return
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise KVEventFormatError(f"{path}, line {i}: not JSON ({e.msg} at column {e.colno}); expected one KV "
                                     f"event batch per line, or a kvexplore recording") from None
        if i == 1 and isinstance(obj, list) and obj and all(isinstance(b, (dict, list)) for b in obj):
            yield from ((f"{path}, batch {j}", b) for j, b in enumerate(obj))  # one JSON list on one line
            return
        yield f"{path}, line {i}", obj


def batch_to_dict(batch: Batch, hex_hashes: bool = True) -> dict[str, Any]:
    """A batch in vLLM's map form (bytes hashes as hex strings for JSON, or as they came for msgpack; int hashes
    stay ints)."""
    h = (lambda x: x.hex() if isinstance(x, bytes) else x) if hex_hashes else (lambda x: x)
    events: list[dict[str, Any]] = []
    for ev in batch.events:
        if isinstance(ev, Stored):
            events.append({"type": "BlockStored", "block_hashes": [h(x) for x in ev.hashes],
                           "parent_block_hash": None if ev.parent is None else h(ev.parent),
                           "token_ids": list(ev.tokens), "block_size": ev.block_size, "lora_id": None,
                           "medium": ev.medium, "lora_name": ev.lora, "group_idx": ev.group, **ev.extra})
        elif isinstance(ev, Removed):
            events.append({"type": "BlockRemoved", "block_hashes": [h(x) for x in ev.hashes], "medium": ev.medium,
                           "group_idx": ev.group})
        elif isinstance(ev, Cleared):
            events.append({"type": "AllBlocksCleared"})
    return {"ts": batch.ts, "events": events, "data_parallel_rank": batch.rank}


def save_kv_events(replay: KVEventReplay, path: str | Path, format: str = "jsonl") -> Path:
    """Write a replay's batches: ``"jsonl"`` (map form with ``seq``, bytes hashes as hex) or ``"recording"`` (msgpack
    payloads in map form). Either reads back into the same blocks, hashes and frames."""
    path = Path(path)
    if format == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for rec in replay.history:
                f.write(json.dumps({"seq": rec.seq, **batch_to_dict(rec.batch)}) + "\n")
    elif format == "recording":
        import msgspec

        with KVEventRecorder(path) as out:
            for rec in replay.history:
                out.write(rec.seq, msgspec.msgpack.encode(batch_to_dict(rec.batch, hex_hashes=False)), rec.rank)
    else:
        raise SettingsError(f"format {format!r}: expected 'jsonl' or 'recording'")
    return path
