"""What the engine dialects share: the context a stream's reader keeps between batches, the media renamed onto
vLLM's names, and the events of a decoded batch looked at before they are read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..schema import Batch, KVEventFormatError, Removed, Stored, read_batch

ENGINE_MEDIUM = "engine_medium"  # Stored.extra key: the medium as the engine named it, where kvexplore renamed it


@dataclass
class Context:
    """What one stream's dialect keeps between its batches: the block size the user gave (for an engine that does not
    send one) and whatever the dialect must remember (Mooncake: each key's block, for its replica updates)."""

    block_size: int | None = None
    memory: dict[Any, Any] = field(default_factory=dict)


def renamed(batch: Batch, name: Callable[[str], str]) -> Batch:
    """``batch`` with each store's and removal's medium renamed by ``name`` (a store keeps the engine's own name in
    ``extra["engine_medium"]`` where it changed)."""
    events = []
    for ev in batch.events:
        if isinstance(ev, (Stored, Removed)) and name(ev.medium) != ev.medium:
            new = name(ev.medium)
            ev = replace(ev, medium=new, extra={**ev.extra, ENGINE_MEDIUM: ev.medium}) if isinstance(ev, Stored) \
                else replace(ev, medium=new)
        events.append(ev)
    return replace(batch, events=tuple(events))


def raw_events(obj: Any) -> list[Any]:
    """The events of a decoded batch in vLLM's layout (map with ``events``, or an array led by ts then events), or
    none when it is not one."""
    if isinstance(obj, dict):
        events = obj.get("events")
    elif isinstance(obj, (list, tuple)) and len(obj) >= 2:
        events = obj[1]
    else:
        return []
    return list(events) if isinstance(events, (list, tuple)) else []


def raw_media(obj: Any) -> set[str]:
    """The medium names a decoded vLLM-layout batch's events give (map events: ``medium``; array events: the field
    after lora_id)."""
    out = set()
    for ev in raw_events(obj):
        if isinstance(ev, dict):
            m = ev.get("medium")
        elif isinstance(ev, (list, tuple)) and ev and ev[0] in ("BlockStored", "BlockRemoved"):
            at = 6 if ev[0] == "BlockStored" else 2
            m = ev[at] if len(ev) > at else None
        else:
            m = None
        if isinstance(m, str):
            out.add(m)
    return out


def read_as_vllm(obj: Any, where: str, hint: str, medium: Callable[[str], str]) -> Batch:
    """A batch of an engine that sends vLLM's layout, read by vLLM's reader (an error also names the engine's
    schema, ``hint``), its media renamed by ``medium``."""
    try:
        batch = read_batch(obj, where, text_hashes=True)
    except KVEventFormatError as e:
        raise KVEventFormatError(f"{e} [read as {hint}]") from None
    return renamed(batch, medium)
