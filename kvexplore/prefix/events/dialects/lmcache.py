"""LMCache's KV cache events, read from LMCache/LMCache: ``lmcache/utils.py`` (``CacheStoreEvent``: block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium; later also lora_name), ``lmcache/v1/cache_engine.py``
(where a store makes one per chunk: ``block_hashes=[chunk_hash]``, ``parent_block_hash`` the previous chunk's hash or
None for the first, ``block_size`` the chunk's token count, so the last chunk of a prompt may be short, ``medium="cpu"``
or the token tensor's device such as ``"cuda:0"``; a CXL backend sends ``"CXL"``) and ``lmcache/v1/kv_events.py`` (a
copy of vLLM's ZMQ publisher: the wire is vLLM's ``EventBatch`` of ``BlockStored``/``BlockRemoved``, topic
``kv-events``). Read as vLLM's schema, then the media renamed onto vLLM's names: ``cpu`` (and LocalCPUBackend) is CPU,
``cuda``/``cuda:N``/``gpu`` is GPU, ``disk``/``local_disk`` (LocalDiskBackend) is STORAGE, any other name upper-cased
(``CXL``); the engine's own name stays in ``Stored.extra["engine_medium"]``. The hashes are LMCache's chunk hashes
(ints), not vLLM's sha256 chain: ``kvexplore kv-events check`` does not recompute them."""

from __future__ import annotations

from typing import Any

from ..schema import Batch
from .common import Context, raw_media, read_as_vllm

HINT = ("LMCache's KV events (LMCache/LMCache lmcache/utils.py CacheStoreEvent, sent as vLLM's EventBatch by "
        "lmcache/v1/kv_events.py)")
MEDIA = {"cpu": "CPU", "localcpubackend": "CPU", "gpu": "GPU", "disk": "STORAGE", "local_disk": "STORAGE",
         "localdiskbackend": "STORAGE"}


def detect(obj: Any) -> bool:
    """LMCache's for sure: a medium in lower case (``cpu``, a torch device like ``cuda:0``), which vLLM never sends."""
    return any(m != m.upper() for m in raw_media(obj))


def medium(name: str) -> str:
    low = name.lower()
    if low.startswith("cuda"):
        return "GPU"
    return MEDIA.get(low, name.upper())


def read(obj: Any, where: str, ctx: Context) -> tuple[Batch, int | None]:
    return read_as_vllm(obj, where, HINT, medium), None
