"""A serving engine's KV cache events (vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) read,
from a file or live from its ZMQ socket, into the frames a :class:`~kvexplore.prefix.pool.PrefixPool` makes
(docs/prefix.md)."""

from __future__ import annotations

from .files import KVEventRecorder, read_kv_events, read_recording, save_kv_events
from .replay import KVEventReplay, Received
from .schema import Batch, Cleared, KVEventFormatError, Removed, Stored, decode_payload, read_batch
from .subscriber import KVEventSubscriber, rank_endpoint, record
from .vllm_hashes import vllm_block_hashes

__all__ = ["Batch", "Cleared", "KVEventFormatError", "KVEventRecorder", "KVEventReplay", "KVEventSubscriber",
           "Received", "Removed", "Stored", "decode_payload", "rank_endpoint", "read_batch", "read_kv_events",
           "read_recording", "record", "save_kv_events", "vllm_block_hashes"]
