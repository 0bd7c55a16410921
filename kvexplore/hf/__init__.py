"""Any transformers causal LM, stepped through its own Cache classes and watched (``hf:dynamic``, ``hf:static``,
...): a :class:`~kvexplore.Generator` drives it as it drives kvexplore's models, and the explorer draws it."""

from __future__ import annotations

from typing import Any

from .cache import HFCache
from .caches import HF_CACHES, available, is_hf_cache
from .model import PREFIX, HFModel, is_hf_model, load_hf, make_cache  # noqa: F401 (PREFIX: "hf:")


def wrap(module: Any, tokenizer: Any = None) -> HFModel:
    """A transformers model (and optionally its tokenizer, a folder or a kvexplore Tokenizer) for kvexplore."""
    return module if isinstance(module, HFModel) else HFModel(module, tokenizer)


__all__ = ["HFCache", "HFModel", "HF_CACHES", "available", "is_hf_cache", "is_hf_model", "load_hf", "make_cache",
           "wrap"]
