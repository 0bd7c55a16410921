"""A CPU stand-in for CUDA's caching allocator statistics, to check the memory arithmetic without a GPU.

While active, :class:`FakeAllocator` sees every storage an operation creates (a dispatch mode) and when the last
reference to it goes (a finalizer on the storage): cumulative bytes allocated and freed and their counts, as
``torch.cuda.memory_stats`` keeps them (without the 512-byte rounding). Give it to a cache as
``cache.allocator``.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class FakeAllocator(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.allocated = self.freed = self.allocations = self.frees = 0
        self._live: weakref.WeakSet = weakref.WeakSet()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._see(t.untyped_storage())
        return out

    def _see(self, storage) -> None:
        if storage in self._live or storage.nbytes() == 0:
            return
        self._live.add(storage)
        n = storage.nbytes()
        self.allocated += n
        self.allocations += 1
        weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        self.freed += n
        self.frees += 1

    # -- the allocator source protocol (kvexplore.core.allocator) -------------------------------------------------
    def counters(self) -> tuple[int, int, int, int]:
        return (self.allocated, self.freed, self.allocations, self.frees)

    def now(self) -> dict[str, int]:
        return {"allocated_bytes": self.allocated - self.freed, "reserved_bytes": 0, "inactive_split_bytes": 0,
                "alloc_retries": 0}
