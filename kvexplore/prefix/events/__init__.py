"""A serving engine's KV cache events (vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; SGLang's,
LMCache's, Dynamo's and Mooncake's read into the same records: docs/engine-events.md) read, from a file or live from
its ZMQ socket, into the frames a :class:`~kvexplore.prefix.pool.PrefixPool` makes (docs/prefix.md), and checked for
drift (:func:`check_kv_events`)."""

from __future__ import annotations

from .check import CheckReport, Finding, check_batches, check_kv_events
from .dialects import ENGINES
from .files import KVEventRecorder, read_kv_events, read_recording, save_kv_events
from .replay import KVEventReplay, Received
from .schema import Batch, Cleared, KVEventFormatError, Removed, Stored, decode_payload, read_batch
from .subscriber import KVEventSubscriber, rank_endpoint, record
from .vllm_hashes import vllm_block_hashes, vllm_chain_hashes

__all__ = ["Batch", "CheckReport", "Cleared", "ENGINES", "Finding", "KVEventFormatError", "KVEventRecorder",
           "KVEventReplay", "KVEventSubscriber", "Received", "Removed", "Stored", "check_batches", "check_kv_events",
           "decode_payload", "rank_endpoint", "read_batch", "read_kv_events", "read_recording", "record",
           "save_kv_events", "vllm_block_hashes", "vllm_chain_hashes"]
