"""Memory accounting: the analytic size of a KV cache and the per-step report every strategy produces."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config.model_config import ModelConfig
from ..config.layer_plan import LayerSpec, layer_plan


def format_bytes(n: float) -> str:
    """Bytes for people, in binary units: 23.2 MiB, 1.5 KiB, 12 B."""
    for unit, step in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= step:
            return f"{n / step:.1f} {unit}"
    return f"{int(n)} B"


def kv_bytes(config: ModelConfig, tokens: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes the model's caches hold for ``batch_size`` sequences of ``tokens`` positions: the sum over layers of
    ``2 * kv_heads * head_dim * element_size * batch * held``, where a full layer holds every position, a sliding
    layer its last ``window`` and a shared layer none. For a model whose layers are all full (Llama) this is
    ``2 * layers * kv_heads * head_dim * element_size * batch * tokens``."""
    return sum(layer_bytes(s, s.held(tokens), batch_size, dtype) for s in layer_plan(config))


def layer_bytes(spec: LayerSpec, positions: int, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of ``positions`` keys and values in one layer: ``2 * kv_heads * head_dim * element_size * batch *
    positions`` (0 for a shared layer)."""
    return spec.position_bytes(dtype.itemsize) * batch_size * positions


@dataclass(frozen=True, slots=True)
class LayerMemory:
    """One layer's cache after a step: its ``kind`` (full, sliding, shared), bytes held and moved."""

    layer: int
    kind: str
    held: int  # positions held
    logical_bytes: int
    reserved_bytes: int
    analytic_bytes: int
    written_bytes: int = 0
    copied_bytes: int = 0
    # every storage reachable from the layer's object and not counted before it (kvexplore.caches.held): its keys
    # and values and what else it keeps (positions, masks, press scores, checkpoints, a shared page table), by part
    held_bytes: int = 0
    parts: dict[str, int] = field(default_factory=dict)


@dataclass
class StepCounters:
    """What one forward pass did to a cache's storage, summed over layers (reset when a write begins)."""

    written_bytes: int = 0  # new keys/values stored
    copied_bytes: int = 0  # existing keys/values copied (a concatenation copies the whole cache)
    allocated_bytes: int = 0  # storages that appeared (a data_ptr not seen before)
    freed_bytes: int = 0  # storages dropped
    allocations: int = 0
    frees: int = 0

    def temporaries(self, nbytes: int, copied: int | None = None) -> None:
        """Two temporaries of ``nbytes`` made and dropped in the step, ``copied`` (default all) from held storage."""
        self.copied_bytes += nbytes if copied is None else copied
        self.allocated_bytes += nbytes
        self.freed_bytes += nbytes
        self.allocations += 2
        self.frees += 2


@dataclass(frozen=True, slots=True)
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
    # CUDA's allocator inside the cache's writes this step: allocated_bytes, freed_bytes, allocations, frees
    # (kvexplore.core.allocator; {} off CUDA), and its figures for the whole process after the step
    cuda: dict[str, int] = field(default_factory=dict)
    cuda_now: dict[str, int] = field(default_factory=dict)
    layers: tuple[LayerMemory, ...] = ()
    # what the cache object really holds once the step is settled: every tensor storage reachable from it, each once,
    # by part ("keys and values", "undo scratch", a layer's positions, masks, press scores, checkpoints, page
    # tables; kvexplore.caches.held), and what the step under way holds on top until it is settled (its undo journal's
    # copies, its reads; 0 after settle()). held_bytes + step_bytes is everything reachable from the cache now.
    held_bytes: int = 0
    held: dict[str, int] = field(default_factory=dict)
    step_bytes: int = 0

    @property
    def extra_bytes(self) -> int:
        """What the cache holds beyond its keys and values (``held_bytes`` less the "keys and values" part)."""
        return self.held_bytes - self.held.get("keys and values", 0)

    def per_layer(self) -> list[LayerMemory]:
        """One report per layer, measured on that layer's own storage (full, sliding and shared layers differ)."""
        return list(self.layers)

    def by_kind(self) -> dict[str, dict[str, int]]:
        """Byte figures summed over the layers of each kind (full, sliding, shared, state)."""
        out: dict[str, dict[str, int]] = {}
        for m in self.layers:
            d = out.setdefault(m.kind, dict(layers=0, logical_bytes=0, reserved_bytes=0, analytic_bytes=0,
                                            written_bytes=0, copied_bytes=0, held_bytes=0))
            d["layers"] += 1
            for name in ("logical_bytes", "reserved_bytes", "analytic_bytes", "written_bytes", "copied_bytes",
                         "held_bytes"):
                d[name] += getattr(m, name)
        return out
