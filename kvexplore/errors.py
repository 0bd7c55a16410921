"""Errors kvexplore raises on purpose: each message names the problem, the value and the fix.

Everything a user can cause (a damaged file, a wrong setting, a call at the wrong time) raises a subclass of
:class:`KVExploreError`, which also subclasses the standard exception a caller would expect (``ValueError`` for
bad values and files, ``FileNotFoundError`` for a missing file, ``RuntimeError`` for a call out of order), so
``except ValueError`` keeps working. An error from a library underneath (safetensors, gguf, tokenizers,
sentencepiece, torch) is wrapped in one of these, with the original kept as ``__cause__``.
"""

from __future__ import annotations

from typing import Any


class KVExploreError(Exception):
    """Base class of every error kvexplore raises for bad input."""


class LoadError(KVExploreError, ValueError):
    """A checkpoint, config or tokenizer could not be loaded (missing file, wrong shape, corrupt data)."""


class MissingFileError(LoadError, FileNotFoundError):
    """A file a model needs is not there."""


class CorruptFileError(LoadError):
    """A file is there but cannot be read as what it claims to be (truncated, bit-flipped, wrong format)."""


class ConfigError(LoadError):
    """A config field (``config.json``, GGUF metadata, tokenizer or generation config) has a value of the
    wrong type or out of range. ``file``, ``field``, ``value`` and ``expected`` say which and why."""

    def __init__(self, file: str, field: str, value: Any, expected: str, fix: str = "",
                 message: str | None = None) -> None:
        self.file, self.field, self.value, self.expected = file, field, value, expected
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        tail = f"; {fix}" if fix else "; fix the file, or download or convert the model again"
        super().__init__(message or f"{file}: {field} is {shown}, expected {expected}{tail}")


class NonFiniteWeightsError(LoadError):
    """A tensor holds NaN or Inf: the model would give NaN logits. ``allow_nonfinite=True`` loads it anyway."""


class UnsupportedModelError(LoadError):
    """The checkpoint is of an architecture or option kvexplore does not implement."""


class SettingsError(KVExploreError, ValueError):
    """An argument or setting of the wrong type or out of range (sampling, cache sizes, rewinds, layers)."""


class StateError(KVExploreError, RuntimeError):
    """A call that the object's current state does not allow (a step before the prefill, a fork of nothing)."""


class StepError(KVExploreError, RuntimeError):
    """A step failed while computing (for example the logits are not finite); the generator and its cache were
    put back exactly as they were before the step."""


class CacheFullError(KVExploreError, RuntimeError):
    """A write would go past the cache's capacity; nothing was written."""

    def __init__(self, used: int, needed: int, capacity: int) -> None:
        self.used, self.needed, self.capacity = used, needed, capacity
        super().__init__(
            f"cache full: {used} of {capacity} slots used and this write needs {needed} more "
            f"({used + needed} > {capacity}); create the cache with a larger max_seq_len "
            f"(at least {used + needed}) or rewind"
        )


class RankError(KVExploreError, RuntimeError):
    """A rank process of a model run over several processes (:mod:`kvexplore.distributed`) died, hung or failed;
    every rank was stopped."""


#: the command that installs the widgets' libraries (the ``notebook`` extra) next to an installed kvexplore, from
#: a source checkout as from a wheel
NOTEBOOK_INSTALL = 'pip install "kvexplore[notebook]"'

#: the top-level modules that come with the notebook extra (its libraries and theirs that kvexplore imports)
NOTEBOOK_MODULES = frozenset({"anywidget", "ipywidgets", "plotly", "traitlets", "IPython", "jupyterlab", "voila"})


class MissingExtraError(KVExploreError, ImportError):
    """A part of kvexplore that needs an optional library was used where that library is not installed: the widgets
    (:class:`~kvexplore.Explorer`, :class:`~kvexplore.PrefixView`, :class:`~kvexplore.PrefixCompare`), the HTML
    replay and ``kvexplore lab``/``app`` need the ``notebook`` extra. ``name`` is the missing module; the message
    says what needed it and the command that installs it. The engine (load, caches, generator, doctor, prefix pool,
    traces) never needs it."""

    def __init__(self, what: str, module: str, extra: str = "notebook") -> None:
        self.what, self.extra = what, extra
        super().__init__(f"{what} needs {module}, which is not installed in this environment; install kvexplore's "
                         f"{extra} extra: pip install \"kvexplore[{extra}]\"", name=module)


def missing_extra(what: str, error: ImportError) -> MissingExtraError | None:
    """The :class:`MissingExtraError` to raise instead of ``error`` when the module it could not import is one of the
    notebook extra's (:data:`NOTEBOOK_MODULES`); ``None`` for any other import error (a real bug, raised as it is)."""
    missing = getattr(error, "name", None) or ""
    if isinstance(error, ModuleNotFoundError) and missing.split(".")[0] in NOTEBOOK_MODULES:
        return MissingExtraError(what, missing.split(".")[0])
    return None
