"""kvexplore's own :class:`~kvexplore.Model` behind the executor contract: its eager forward pass, its caches (any
:class:`~kvexplore.KVCache`), and its compiled one-token step where the cache allows one."""

from __future__ import annotations

from typing import Any

import torch

from ..caches.base import KVCache
from ..caches.factory import make_cache
from ..errors import SettingsError
from ..models.model import Model
from ..models.executor import ADAPTERS, CompiledExecutor, Executor, register_adapter


class EagerExecutor(Executor):
    """``model`` (a :class:`~kvexplore.Model`) run eagerly; its config, tokenizer and source are read through, so a
    tokenizer set on the model later is the one used."""

    def __init__(self, model: Model) -> None:
        self._model = model

    model = property(lambda self: self._model)
    config = property(lambda self: self._model.config)
    tokenizer = property(lambda self: self._model.tokenizer)
    source = property(lambda self: self._model.source)
    device = property(lambda self: self._model.device)
    dtype = property(lambda self: self._model.dtype)

    def __call__(self, ids: torch.Tensor, cache: KVCache, pos: int, tracer: Any = None, last_only: bool = False,
                 keep_undo: bool = False) -> torch.Tensor:
        return self._model(ids, cache, pos, tracer=tracer, last_only=last_only, keep_undo=keep_undo)

    def check_cache(self, cache: Any) -> None:
        if not isinstance(cache, KVCache):
            raise SettingsError(f"cache must be a KVCache (from kvexplore.make_cache), got {type(cache).__name__}")

    def default_cache(self) -> KVCache:
        return make_cache("preallocated", self._model)

    def compile_refusal(self, cache: Any) -> str | None:
        from ..fast.compiled import refusal

        return refusal(self._model, cache)

    def compiled(self, cache: Any, mode: str | None) -> CompiledExecutor:
        from ..fast.compiled import CompiledStep

        return CompiledStep(self, mode)

    def __repr__(self) -> str:
        return f"EagerExecutor({self._model.config.architecture}, {self._model.config.num_layers} layers)"


register_adapter(lambda model: isinstance(model, Model), EagerExecutor, name="kvexplore")
ADAPTERS.seal()  # built in (kvexplore.hf adds "transformers")
