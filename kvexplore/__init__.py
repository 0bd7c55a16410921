"""kvexplore: a small Llama-family inference engine whose KV cache is a first-class, inspectable object.

``import kvexplore`` loads the engine: models, caches, the generator and its records. The labs (the doctor, the
prefix pool, trace diffs, the transformers bridge ``kvexplore.hf``), the speed stack (``kvexplore.fast``) and the
screen (the HTML replay, the notebook widgets) load on first use of one of their names. The widgets
(:class:`Explorer`, :class:`PrefixView`, :class:`PrefixCompare`) need the notebook extra, and without it raise
:class:`~kvexplore.errors.MissingExtraError` naming the missing module and ``pip install "kvexplore[notebook]"``.
"""

from importlib import import_module
from importlib.util import find_spec

from .caches import KVCache, SlotView, make_cache
from .config.model_config import ModelConfig
from .errors import (CacheFullError, ConfigError, CorruptFileError, KVExploreError, LoadError, MissingExtraError,
                     MissingFileError, NonFiniteWeightsError, SettingsError, StateError, StepError,
                     UnsupportedModelError)
from .runtime.generator import Generator
from .formats.loading import load
from .caches.memory import MemoryReport, kv_bytes
from .models.model import Model, hook_point_names
from .trace.records import Candidate, StepRecord
from .formats.tokenizer import Tokenizer
from .trace.tracer import CacheEvent, StepTrace, Tracer
from .trace.files import load_trace, save_trace

__version__ = "0.1.0"

#: the names that load their module on first use: name -> (module, attribute)
LAZY = {
    **{name: (".caches", name) for name in ("ConcatCache", "EvictCache", "NoCache", "PagedCache", "PreallocatedCache",
                                            "QuantizedCache", "SinkCache")},  # each strategy's module when first used
    "doctor": (".diagnosis", "doctor"), "DoctorReport": (".diagnosis", "DoctorReport"),
    "perplexity": (".runtime.evaluate", "perplexity"), "PrefixPool": (".prefix", "PrefixPool"),
    "TraceDiff": (".trace.diff", "TraceDiff"), "diff_traces": (".trace.diff", "diff_traces"),
}
#: the notebook widgets, from the explorer (they need the notebook extra)
WIDGETS = ("Explorer", "PrefixCompare", "PrefixView")
#: the subpackages ``kvexplore.<name>`` gives without an import of its own (as before they loaded on first use)
SUBPACKAGES = ("bugs", "caches", "cli", "compression", "config", "core", "course", "diagnosis", "explorer", "fast",
               "formats", "hf", "models", "prefix", "replay", "runtime", "speculation", "trace", "views")


def _widgets_available() -> bool:
    """Whether the widgets' libraries are installed (looked up, not imported)."""
    try:
        return all(find_spec(module) is not None for module in ("anywidget", "ipywidgets", "plotly", "traitlets"))
    except ValueError:  # a module already imported without a spec: there, at least
        return True


__all__ = [
    "CacheEvent", "CacheFullError", "ConfigError", "CorruptFileError", "MissingExtraError", "MissingFileError",
    "NonFiniteWeightsError", "SettingsError", "StateError", "StepError", "Candidate", "ConcatCache", "Generator",
    "KVCache", "KVExploreError", "LoadError", "MemoryReport", "Model", "ModelConfig", "SlotView", "StepRecord",
    "StepTrace",
    "Tokenizer", "Tracer", "UnsupportedModelError", "hook_point_names", "kv_bytes", "load", "load_trace",
    "make_cache", "save_trace", *LAZY,
] + (sorted(WIDGETS) if _widgets_available() else [])  # widgets: only where they import


def __getattr__(name: str):
    """The labs' names and the widgets, imported on first use (the widgets need the notebook extra; without it,
    MissingExtraError)."""
    if name in LAZY:
        module, attribute = LAZY[name]
        value = getattr(import_module(module, __name__), attribute)
    elif name in WIDGETS:
        value = getattr(import_module(".explorer", __name__), name)
    elif name in SUBPACKAGES:
        value = import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:  # the widgets where they can be imported (help() and tab completion get each name)
    return sorted(set(globals()) | set(LAZY) | (set(WIDGETS) if _widgets_available() else set()))
