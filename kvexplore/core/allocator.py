"""What the device's memory allocator did, read where a cache claims it: around the cache's own writes
(``MemoryReport.cuda``), and for the whole process after the step (``cuda_now``; docs/cuda.md). A source is any
:class:`AllocatorStats` (the tests give the caches a fake one on the CPU); ``cache.allocator = None`` skips the
reads, which cost a few tens of microseconds on CUDA."""

from __future__ import annotations

from typing import Protocol

import torch

COUNTERS = ("allocated_bytes", "freed_bytes", "allocations", "frees")
NOW = ("allocated_bytes", "reserved_bytes", "inactive_split_bytes", "alloc_retries")


class AllocatorStats(Protocol):
    def counters(self) -> tuple[int, int, int, int]:
        """Cumulative bytes allocated, bytes freed, allocations and frees since the process began."""

    def now(self) -> dict[str, int]:
        """The figures of :data:`NOW` at this moment."""


class CudaAllocator:
    """CUDA's caching allocator on one device (one nested-stats read per call, no flattening)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _stats(self) -> dict:
        return torch.cuda.memory_stats_as_nested_dict(self.device)

    def counters(self) -> tuple[int, int, int, int]:
        s = self._stats()
        if not s:  # the allocator has not started yet
            return (0, 0, 0, 0)
        b, n = s["allocated_bytes"]["all"], s["allocation"]["all"]
        return (int(b["allocated"]), int(b["freed"]), int(n["allocated"]), int(n["freed"]))

    def now(self) -> dict[str, int]:
        s = self._stats()
        if not s:
            return dict.fromkeys(NOW, 0)
        return {"allocated_bytes": int(s["allocated_bytes"]["all"]["current"]),
                "reserved_bytes": int(s["reserved_bytes"]["all"]["current"]),
                "inactive_split_bytes": int(s["inactive_split_bytes"]["all"]["current"]),
                "alloc_retries": int(s.get("num_alloc_retries", 0))}


def allocator_for(device: torch.device) -> AllocatorStats | None:
    """The allocator source of ``device``: CUDA's, or None where there is none to read (the CPU)."""
    return CudaAllocator(device) if device.type == "cuda" else None


class Window:
    """Allocator counters summed over the windows a step measured: ``with window:`` around each one."""

    def __init__(self, source: AllocatorStats | None) -> None:
        self.source = source
        self.totals = [0, 0, 0, 0]

    def __enter__(self) -> "Window":
        self._before = self.source.counters() if self.source is not None else None
        return self

    def __exit__(self, *exc) -> None:
        if self._before is not None:
            after = self.source.counters()
            for i in range(4):
                self.totals[i] += after[i] - self._before[i]

    def figures(self) -> dict[str, int]:
        """The step's figures by name ({} without a source)."""
        return dict(zip(COUNTERS, self.totals)) if self.source is not None else {}
