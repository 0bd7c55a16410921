"""A real vLLM engine's prefix cache, recorded and shipped with kvexplore (``kvexplore/data/vllm_engine``, its
README.md): each scenario's requests, vLLM's answers and hits, and the KV cache events it published, as
:class:`Recording`. The course's notebook 16 and the suite replay them without vLLM."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import SettingsError

FOLDER = Path(__file__).resolve().parents[2] / "data" / "vllm_engine"


@dataclass(frozen=True)
class Recording:
    name: str
    scenario: str
    retention_interval: int | None   # vLLM's prefix_cache_retention_interval
    num_blocks: int | None           # its num_gpu_blocks_override (None: 1 GiB of KV cache)
    vllm: str                        # vLLM's version
    requests: list[list[int]]        # each request's prompt token ids
    answers: list[list[int]]         # vLLM's greedy answer to each
    hits: list[int]                  # vLLM's num_cached_tokens for each
    rows: list[dict[str, Any]]       # the benchmark's row per request (both sides' hits, why kvexplore recomputed)
    events: Path                     # the KV event recording (kvexplore.prefix.events.read_kv_events reads it)
    folder: Path = field(repr=False, default=FOLDER)


def names() -> list[str]:
    """The recorded scenarios: ``smollm2-0``, ..., ``gemma3-0``, ..."""
    return sorted(p.parent.name for p in FOLDER.glob("*/run.json"))


def load(name: str) -> Recording:
    folder = FOLDER / name
    if not (folder / "run.json").exists():
        raise SettingsError(f"no recorded vLLM scenario {name!r}; there are {', '.join(names())}")
    run = json.loads((folder / "run.json").read_text())
    results = run["vllm_results"]
    return Recording(name, run["scenario"], run["retention_interval"], run["num_blocks"], run["vllm"], run["requests"],
                     [r["tokens"] for r in results], [r["cached"] for r in results], run["rows"],
                     folder / "events.kvev", folder)
