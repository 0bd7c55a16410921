"""The executor contract: everything a :class:`~kvexplore.Generator` asks of what runs the model.

The generator decides the sequence, the positions, the sampling and the records; an executor runs one forward pass
over a cache and returns logits (eager, compiled, transformers: docs/extending.md, "Executors"). A model that is
not an executor yet is wrapped by the adapter registered for it (:func:`register_adapter`, :func:`as_executor`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from importlib import import_module
from typing import Any

import torch

from ..core.registry import Registry
from ..errors import SettingsError


class Executor(ABC):
    """Runs forward passes of one model over a cache for a :class:`~kvexplore.Generator`. What the generator reads
    besides the call: ``config``, ``tokenizer`` (or None: ids only), ``device``, ``dtype``, ``source`` (a name for
    saved traces) and :attr:`model`."""

    config: Any
    tokenizer: Any
    source: str | None

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the model's weights live (the logits come back from here)."""

    @property
    @abstractmethod
    def dtype(self) -> torch.dtype:
        """The model's weights' dtype."""

    @property
    def model(self) -> Any:
        """The model object a user handed over, as ``Generator.model`` shows it (by default the executor itself)."""
        return self

    @abstractmethod
    def __call__(self, ids: torch.Tensor, cache: Any, pos: int, tracer: Any = None, last_only: bool = False,
                 keep_undo: bool = False) -> torch.Tensor:
        """One forward pass of ``ids`` ``(1, T)`` (a CPU tensor) at positions ``pos..pos+T-1`` through ``cache``:
        float32 logits ``(1, T, vocab)`` (``(1, 1, vocab)`` with ``last_only``), on the model's device.

        The pass leaves ``cache`` committed at ``pos + T`` (through :func:`~kvexplore.caches.one_pass.one_pass`); one
        that fails leaves it as it was. ``keep_undo`` keeps what ``cache.rollback()`` needs until ``cache.settle()``.
        ``tracer`` gets the pass's hook points through ``tracer.hook(name, tensor)``.
        """

    @abstractmethod
    def check_cache(self, cache: Any) -> None:
        """Raise SettingsError, naming the cache to use, if this executor cannot run ``cache``."""

    @abstractmethod
    def default_cache(self) -> Any:
        """The cache a ``Generator(model)`` without one gets."""

    def replay(self, ids: Sequence[int], cache: Any) -> None:
        """Rebuild ``cache`` as a prefill of ``ids`` leaves it (a rewind past a sliding ring or a recurrent state); by
        default one pass at position 0, which rolls back on failure; no ids: truncated to 0."""
        cache.settle()
        if not ids:
            cache.truncate(0)
            return
        self(torch.tensor([list(ids)], dtype=torch.long), cache, 0, last_only=True)

    def cut_back(self, ids: Sequence[int], cache: Any) -> None:
        """Bring ``cache`` back to holding ``ids`` (a prefix of what it holds): a truncate, or, where a sliding ring
        or a recurrent state cannot go back, a :meth:`replay` of ``ids``."""
        if cache.inspect.needs_replay(len(ids)):
            self.replay(ids, cache)
        else:
            cache.truncate(len(ids))

    def compile_refusal(self, cache: Any) -> str | None:
        """Why one-token steps through ``cache`` cannot run compiled (None: :meth:`compiled` gives a step)."""
        return f"{type(self).__name__} has no compiled decode step (compiled decoding runs kvexplore's own model)"

    def compiled(self, cache: Any, mode: str | None) -> "CompiledExecutor":
        """The compiled one-token step for ``cache`` in torch.compile ``mode`` (None: the best for the device);
        only where :meth:`compile_refusal` gave None."""
        raise SettingsError(self.compile_refusal(cache) or "no compiled decode step")


class CompiledExecutor(Executor):
    """A one-token step compiled ahead of use: the generator calls it for single-token steps with ``last_only`` and
    falls back to the eager executor for the rest."""

    @abstractmethod
    def sees_inside(self, tracer: Any) -> bool:
        """Whether ``tracer`` wants hook points inside the layers (attention, q/k/v), which a compiled graph does
        not have: such a step runs eager."""

    @abstractmethod
    def compile_s(self, cache: Any) -> float | None:
        """Seconds the first compiled step for ``cache`` took to compile (None before it)."""

    def reuse_note(self, cache: Any) -> str:
        """After the first compiled step: whether it was loaded from a step an earlier process compiled, rebuilt or
        saved for the next ("" where the executor keeps no such cache)."""
        return ""

    def check_cache(self, cache: Any) -> None:
        if why := self.compile_refusal(cache):
            raise SettingsError(why)

    def default_cache(self) -> Any:
        raise SettingsError("a compiled step runs the cache it was built for: make the cache with the eager model")


#: name -> (accepts, adapt): a model that ``accepts(model)`` becomes the executor ``adapt(model)``; the first
#: registered that accepts a model runs it (see :func:`as_executor`)
ADAPTERS: Registry = Registry("model adapter", "unregister_adapter")


def register_adapter(accepts: Callable[[Any], bool], adapt: Callable[[Any], Executor], name: str | None = None,
                     replace: bool = False) -> str:
    """Make models that ``accepts`` runnable by a Generator through ``adapt(model)`` (an :class:`Executor`), under
    ``name`` (default: ``adapt``'s qualified name); returns the name. :func:`unregister_adapter` removes it."""
    if not callable(accepts) or not callable(adapt):
        raise SettingsError("register_adapter(accepts, adapt): both are functions of a model (a test, and the "
                            "Executor that runs it)")
    name = name if name is not None else getattr(adapt, "__qualname__", type(adapt).__name__)
    ADAPTERS.add(name, (accepts, adapt), replace)
    return name


def unregister_adapter(name: str) -> tuple:
    """Remove an adapter :func:`register_adapter` added; returns its ``(accepts, adapt)``."""
    return ADAPTERS.remove(name)


def as_executor(model: Any) -> Executor:
    """``model`` if it is an :class:`Executor`, else the registered adapter's executor for it."""
    if isinstance(model, Executor):
        return model
    if type(model).__module__.startswith("transformers.") and "transformers" not in ADAPTERS:
        import_module("kvexplore.hf")  # registers the transformers adapter (loaded on first use)
    for accepts, adapt in ADAPTERS.values():
        if accepts(model):
            return adapt(model)
    raise SettingsError(f"model must be a kvexplore Model (from kvexplore.load), a transformers model or a "
                        f"kvexplore.models.executor.Executor, got {type(model).__name__} (a transformers model "
                        f"runs once kvexplore.hf is imported, or pass kvexplore.hf.wrap(model))")
