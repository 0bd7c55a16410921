"""KV cache strategies, all behind :class:`KVCache`."""

from .base import KVCache
from .none import NoCache
from .preallocated import PreallocatedCache

__all__ = ["KVCache", "NoCache", "PreallocatedCache"]
