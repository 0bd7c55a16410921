"""kvexplore: a small Llama-family inference engine whose KV cache is a first-class, inspectable object.

The engine needs only the base requirements. The notebook widgets (:class:`Explorer`, :class:`PrefixView`,
:class:`PrefixCompare`) are imported on first use (``kvexplore.Explorer``, ``from kvexplore import Explorer``): they
need the notebook extra, and without it raise :class:`~kvexplore.errors.MissingExtraError` naming the missing module
and ``pip install "kvexplore[notebook]"``.
"""

from . import hf  # registers the hf: caches (kvexplore.caches.registry.PREFIXES) and transformers executors
from . import replay  # registers History.save_html's writer (kvexplore.trace.files.register_html_writer)
from .caches import (ConcatCache, EvictCache, KVCache, NoCache, PagedCache, PreallocatedCache, QuantizedCache, SinkCache,
                     SlotView, make_cache)
from .config.model_config import ModelConfig
from .diagnosis import DoctorReport, doctor
from .errors import (CacheFullError, ConfigError, CorruptFileError, KVExploreError, LoadError, MissingExtraError,
                     MissingFileError, NonFiniteWeightsError, SettingsError, StateError, StepError,
                     UnsupportedModelError)
from .runtime.evaluate import perplexity
from .runtime import products as _products  # installs the one-row product kernel (kvexplore.models.linear)
from . import explorer as _explorer  # the session and view registry; its widgets load on first use (__getattr__)
from .runtime.generator import Generator
from .formats.loading import load
from .prefix import PrefixPool
from .caches.memory import MemoryReport, kv_bytes
from .models.model import Model, hook_point_names
from .trace.records import Candidate, StepRecord
from .formats.tokenizer import Tokenizer
from .trace.tracer import CacheEvent, StepTrace, Tracer
from .trace.diff import TraceDiff, diff_traces
from .trace.files import load_trace, save_trace

__version__ = "0.1.0"

__all__ = [
    "CacheEvent", "CacheFullError", "ConfigError", "CorruptFileError", "MissingExtraError", "MissingFileError",
    "NonFiniteWeightsError", "SettingsError", "StateError", "StepError", "Candidate", "ConcatCache", "Generator", "KVCache", "KVExploreError",
    "LoadError", "MemoryReport", "Model", "ModelConfig", "NoCache", "PagedCache", "PreallocatedCache",
    "QuantizedCache", "SinkCache", "EvictCache", "SlotView", "StepRecord", "StepTrace", "Tokenizer", "Tracer",
    "UnsupportedModelError", "hook_point_names", "kv_bytes", "load", "load_trace", "make_cache", "diff_traces", "TraceDiff", "doctor", "DoctorReport", "perplexity", "save_trace", "PrefixPool",
] + (sorted(_explorer.WIDGETS) if _explorer.widgets_available() else [])  # widgets: only where they import


def __getattr__(name: str):
    """The widgets, imported on first use (they need the notebook extra; without it, MissingExtraError)."""
    if name not in _explorer.WIDGETS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_explorer, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:  # the widgets where they can be imported (help() and tab completion get each name)
    return sorted(set(globals()) | (set(_explorer.WIDGETS) if _explorer.widgets_available() else set()))
