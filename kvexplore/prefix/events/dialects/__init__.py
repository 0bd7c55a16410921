"""Other serving engines' KV cache events read into vLLM's records (:class:`~kvexplore.prefix.events.schema.Batch` of
``Stored``/``Removed``/``Cleared``), one module a dialect: SGLang, LMCache, NVIDIA Dynamo's router events, Mooncake
Store's events (docs/engine-events.md: what each sends and lacks, and the media renamed onto vLLM's GPU, CPU and
STORAGE: vLLM 0.32's vllm/v1/kv_offload/base.py ``Medium``).
:func:`detect` names the engine of a stream where its content says so for sure; else it is read as vLLM's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ....errors import SettingsError
from ..schema import Batch, read_batch
from . import dynamo, lmcache, mooncake, sglang
from .common import Context

VLLM = "vllm"
#: engine name -> its dialect module; detection asks them in this order (the most distinctive first)
DIALECTS = {"dynamo": dynamo, "mooncake": mooncake, "sglang": sglang, "lmcache": lmcache}
ENGINES = (VLLM, *DIALECTS)
DETECT_FIRST = 64  # batches looked at to tell the engine


def engine_name(engine: str | None) -> str | None:
    """``engine`` checked (None: tell it from the content)."""
    if engine is None:
        return None
    name = engine.lower()
    if name not in ENGINES:
        raise SettingsError(f"engine {engine!r}: kvexplore reads the KV events of {', '.join(ENGINES)}")
    return name


def detect(objs: Iterable[Any]) -> str:
    """The engine whose events these decoded batches are, told from the first :data:`DETECT_FIRST` of them: a
    dialect whose marks they bear (a RouterEvent, Mooncake's event names, SGLang's ``attn_dp_rank`` or tier names,
    LMCache's lower-case media), else vLLM (the others send vLLM's layout, and read alike)."""
    for n, obj in enumerate(objs):
        if n >= DETECT_FIRST:
            break
        for name, module in DIALECTS.items():
            if module.detect(obj):
                return name
    return VLLM


def read(engine: str, obj: Any, where: str, ctx: Context) -> tuple[Batch, int | None]:
    """One decoded batch of ``engine`` -> (:class:`Batch`, the sequence number it carries, or None)."""
    if engine == VLLM:
        return read_batch(obj, where, text_hashes=True), None
    return DIALECTS[engine].read(obj, where, ctx)


__all__ = ["DIALECTS", "ENGINES", "VLLM", "Context", "detect", "engine_name", "read"]
