"""A serving engine's KV cache events (vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) read into
the same :class:`~kvexplore.prefix.frames.PoolFrame` s a :class:`~kvexplore.prefix.pool.PrefixPool` makes: from a
file, or live from the engine's ZMQ socket. This module gathers the public names; each lives in its own module:

- :mod:`.schema`: one batch's payload decoded (map and array forms, bytes and int hashes);
- :mod:`.state`: one cache's blocks and slots as the events leave them;
- :mod:`.frame_maker`: a frame of a cache after a batch, and the batch in words;
- :mod:`.replay`: :class:`KVEventReplay`, fed batch by batch, one cache per (rank, medium, group);
- :mod:`.files`: recordings and JSON lines, :func:`read_kv_events`;
- :mod:`.subscriber`: :class:`KVEventSubscriber` (pyzmq) and :func:`record`.

::

    replay = read_kv_events("events.kvev")          # or KVEventSubscriber("tcp://host:5557").collect(10)
    print(replay.summary())
    frames = replay.frames(tokenizer, rank=0, medium="GPU")
"""

from __future__ import annotations

from .files import KVEventRecorder, read_kv_events, read_recording, save_kv_events
from .replay import KVEventReplay, Received
from .schema import Batch, Cleared, KVEventFormatError, Removed, Stored, decode_payload, read_batch
from .subscriber import KVEventSubscriber, rank_endpoint, record

__all__ = ["Batch", "Cleared", "KVEventFormatError", "KVEventRecorder", "KVEventReplay", "KVEventSubscriber",
           "Received", "Removed", "Stored", "decode_payload", "rank_endpoint", "read_batch", "read_kv_events",
           "read_recording", "record", "save_kv_events"]
