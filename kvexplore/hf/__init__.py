"""Any transformers causal LM, stepped through its own Cache classes and watched (``hf:dynamic``, ``hf:static``,
...): a :class:`~kvexplore.Generator` drives it as it drives kvexplore's models, and the explorer draws it.

    model = kvexplore.hf.wrap(AutoModelForCausalLM.from_pretrained(folder), tokenizer)   # or load_hf(folder)
    gen = kvexplore.Generator(model, kvexplore.hf.make_cache(model, "static", max_seq_len=128))
"""

from __future__ import annotations

from typing import Any

from ..errors import SettingsError
from .cache import HFCache
from .caches import HF_CACHES, available, is_hf_cache
from .model import HFModel, is_hf_model, load_hf

PREFIX = "hf:"


def wrap(module: Any, tokenizer: Any = None) -> HFModel:
    """A transformers model (and optionally its tokenizer, a folder or a kvexplore Tokenizer) for kvexplore."""
    return module if isinstance(module, HFModel) else HFModel(module, tokenizer)


def make_cache(model: HFModel, kind: str = "dynamic", max_seq_len: int | None = None) -> HFCache:
    """An :class:`HFCache` of transformers' cache ``kind`` (``"dynamic"``, ``"static"``, ...; see
    :data:`HF_CACHES`; an ``"hf:"`` prefix is accepted) for ``model``. ``max_seq_len`` sizes a static cache
    (default 256)."""
    from .caches import BOUNDED, make_hf_cache

    if not isinstance(model, HFModel):
        raise SettingsError(f"transformers caches (hf:...) run on a transformers model: wrap it with "
                            f"kvexplore.hf.wrap(model, tokenizer), got {type(model).__name__}")
    name = kind.removeprefix(PREFIX)
    slots = 256 if max_seq_len is None else int(max_seq_len)
    fresh = lambda: make_hf_cache(name, model.hf, slots)  # noqa: E731
    return HFCache(PREFIX + name, fresh(), model.config, model.dtype, model.device,
                   slots if name in BOUNDED else None, fresh)


__all__ = ["HFCache", "HFModel", "HF_CACHES", "available", "is_hf_cache", "is_hf_model", "load_hf", "make_cache", "wrap"]
