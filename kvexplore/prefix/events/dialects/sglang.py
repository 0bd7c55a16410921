"""SGLang's KV cache events, read from sgl-project/sglang ``python/sglang/srt/disaggregation/kv_events.py`` (commits
006d053f and 612d5790): msgspec ``array_like`` structs with ``omit_defaults``, so a batch is
``[ts, events, attn_dp_rank]`` (the trailing rank left out when unset, in the older commit absent) and an event is
``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id]``, ``["BlockRemoved",
block_hashes]`` or ``["AllBlocksCleared"]``: vLLM's early layout, field for field, with int hashes. A JSON dump of the
same structs is the map form (``{"ts", "events", "attn_dp_rank"}``, events with ``type``).

HiCache adds a trailing ``medium`` to stores and removals (``MEDIUM_GPU = "GPU"``, ``MEDIUM_CPU_TIER1 =
"CPU_TIER1"``, ``MEDIUM_CPU_TIER2 = "CPU_TIER2"``: the constants of SGLang's HiCache work for Dynamo's router, seen in
a branch of ``kv_events.py`` and ``mem_cache/hiradix_cache.py``, not in the upstream commits above). kvexplore renames
them onto vLLM's names: GPU (HiCache's L1, device memory) stays GPU, CPU_TIER1 (L2, host memory) is CPU, CPU_TIER2 (L3,
a storage backend: disk, 3FS, Mooncake) is STORAGE; the engine's own name stays in ``Stored.extra["engine_medium"]``.
SGLang has no KV cache groups: every block is group 0."""

from __future__ import annotations

from typing import Any

from ..schema import Batch, KVEventFormatError
from .common import Context, raw_media, read_as_vllm

HINT = ("SGLang's KV event schema (sgl-project/sglang python/sglang/srt/disaggregation/kv_events.py): "
        "[ts, events, attn_dp_rank], events [type, block_hashes, parent_block_hash, token_ids, block_size, lora_id, "
        "medium]")
MEDIA = {"GPU": "GPU", "CPU_TIER1": "CPU", "CPU_TIER2": "STORAGE"}
OWN_MEDIA = {"CPU_TIER1", "CPU_TIER2"}  # names vLLM never sends: a stream that has them is SGLang's


def detect(obj: Any) -> bool:
    """SGLang's for sure: a map batch naming ``attn_dp_rank``, or HiCache's tier names as media."""
    return (isinstance(obj, dict) and "attn_dp_rank" in obj) or bool(raw_media(obj) & OWN_MEDIA)


def medium(name: str) -> str:
    return MEDIA.get(name, name)


def read(obj: Any, where: str, ctx: Context) -> tuple[Batch, int | None]:
    if isinstance(obj, dict) and "attn_dp_rank" in obj:
        if obj.get("data_parallel_rank") is not None:
            raise KVEventFormatError(f"{where}: the batch has both attn_dp_rank (SGLang) and data_parallel_rank "
                                     f"(vLLM): which engine wrote it? pass engine='vllm' to read it as vLLM's")
        obj = {**{k: v for k, v in obj.items() if k != "attn_dp_rank"}, "data_parallel_rank": obj["attn_dp_rank"]}
    return read_as_vllm(obj, where, HINT, medium), None
