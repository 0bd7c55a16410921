"""Memory accounting: the analytic size of a KV cache and the per-step report every strategy produces."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import ModelConfig


def format_bytes(n: float) -> str:
    """Bytes for people, in binary units: 23.2 MiB, 1.5 KiB, 12 B."""
    for unit, step in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= step:
            return f"{n / step:.1f} {unit}"
    return f"{int(n)} B"


def kv_bytes(config: ModelConfig, tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes to hold keys and values for ``tokens`` positions of ``batch_size`` sequences:
    ``2 * layers * kv_heads * head_dim * element_size * batch * tokens``."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize * batch_size * tokens


@dataclass
class StepCounters:
    """What one forward pass did to a cache's storage, summed over layers (reset when a write begins)."""

    written_bytes: int = 0  # new keys/values stored
    copied_bytes: int = 0  # existing keys/values copied (a concatenation copies the whole cache)
    allocated_bytes: int = 0  # storages that appeared (a data_ptr not seen before)
    freed_bytes: int = 0  # storages dropped
    allocations: int = 0
    frees: int = 0


@dataclass(frozen=True)
class MemoryReport:
    """A cache's memory after a step. Every figure is exact and checkable against the formula."""

    length: int  # positions held
    logical_bytes: int  # bytes of the slots holding positions
    reserved_bytes: int  # bytes of storage the cache holds, used or not
    analytic_bytes: int  # 2 * layers * kv_heads * head_dim * element_size * batch * positions held
    written_bytes: int = 0
    copied_bytes: int = 0
    allocated_bytes: int = 0
    freed_bytes: int = 0
    allocations: int = 0
    frees: int = 0
    cuda: dict[str, int] = field(default_factory=dict)  # deltas of torch.cuda.memory_stats() over the step
    cuda_now: dict[str, int] = field(default_factory=dict)  # the same statistics after the step (absolute)
    layers: int = 1

    def per_layer(self) -> dict[str, int]:
        """Each byte figure for one layer. Every strategy stores and moves the same amount in each layer (same
        shapes, same positions), so a layer's share is exactly the total divided by the number of layers."""
        names = ("logical_bytes", "reserved_bytes", "analytic_bytes", "written_bytes", "copied_bytes",
                 "allocated_bytes", "freed_bytes", "allocations", "frees")
        return {name: getattr(self, name) // self.layers for name in names}


CUDA_STATS = {"allocated_bytes": "allocated_bytes.all.current", "reserved_bytes": "reserved_bytes.all.current",
              "inactive_split_bytes": "inactive_split_bytes.all.current", "alloc_retries": "num_alloc_retries"}


def cuda_stats(device: torch.device) -> dict[str, int]:
    """The allocator figures kvexplore reports (fragmentation = inactive split bytes), or {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {name: int(stats.get(key, 0)) for name, key in CUDA_STATS.items()}
