"""kvexplore: a small Llama-family inference engine whose KV cache is a first-class, inspectable object."""

from . import hf  # registers the hf: caches (kvexplore.caches.registry.PREFIXES) and transformers executors
from . import replay  # registers History.save_html's writer (kvexplore.trace.files.register_html_writer)
from .caches import (ConcatCache, EvictCache, KVCache, NoCache, PagedCache, PreallocatedCache, QuantizedCache, SinkCache,
                     SlotView, make_cache)
from .config.model_config import ModelConfig
from .diagnosis import DoctorReport, doctor
from .errors import (CacheFullError, ConfigError, CorruptFileError, KVExploreError, LoadError, MissingFileError,
                     NonFiniteWeightsError, SettingsError, StateError, StepError, UnsupportedModelError)
from .runtime.evaluate import perplexity
from .explorer import Explorer, PrefixCompare, PrefixView
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
    "CacheEvent", "CacheFullError", "ConfigError", "CorruptFileError", "Explorer", "MissingFileError", "PrefixCompare", "PrefixView",
    "NonFiniteWeightsError", "SettingsError", "StateError", "StepError", "Candidate", "ConcatCache", "Generator", "KVCache", "KVExploreError",
    "LoadError", "MemoryReport", "Model", "ModelConfig", "NoCache", "PagedCache", "PreallocatedCache",
    "QuantizedCache", "SinkCache", "EvictCache", "SlotView", "StepRecord", "StepTrace", "Tokenizer", "Tracer",
    "UnsupportedModelError", "hook_point_names", "kv_bytes", "load", "load_trace", "make_cache", "diff_traces", "TraceDiff", "doctor", "DoctorReport", "perplexity", "save_trace", "PrefixPool",
]
