"""What the evict cache's tests share (tests/labs/test_evict_presses.py, tests/labs/test_evict_storage.py and
tests/labs/test_evict_rewinds.py): the random-weight models they run on (the ``models`` fixture, imported by name into
each test module), the presses' options, a prompt of random token ids, and an evict cache with room to decode."""

from __future__ import annotations

import pytest
import torch

import kvexplore
from zoo import VARIANTS

MODELS = {"gqa2": ("llama", dict(heads=4, kv_heads=2)), "gqa8": ("qwen2", dict(heads=8, kv_heads=1, tied=True)),
          "mha": ("llama", dict(heads=4, kv_heads=4)), "gemma3": ("gemma3", dict(layers=3)),
          "qwen3next": ("qwen3_next", dict(layers=4)), "gptoss": ("gpt_oss", dict(layers=2)),
          "gemma4": ("gemma4", {}), "llama3": VARIANTS["llama3-rope-tied"]}
OPTS = {"snapkv": dict(window=4, kernel=3, pooling="max"), "streaming": dict(sinks=3), "h2o": dict(recent_ratio=0.25),
        "snapkv-avg": dict(window=5, kernel=5, pooling="avg")}


@pytest.fixture(scope="module")
def models(zoo):
    def get(name):
        arch, options = MODELS[name]
        return zoo.load(arch, **options)
    return get


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (1, n), generator=g)


def evict(model, **options):
    options.setdefault("max_seq_len", 64)
    return kvexplore.make_cache("evict", model, **options)
