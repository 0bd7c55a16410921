"""The few places that move data between the device and the host, on purpose (docs/cuda.md): :func:`fetch` brings any
number of tensors over in one copy (one sync on CUDA), :func:`values` the Python numbers a layer needs mid-pass,
:func:`upload` sends host data without a sync. A test mode fails on any conversion of a device tensor outside this
module and counts the transfers made here (``tests/support/devicemode.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

#: the host, where fetched tensors land
HOST = torch.device("cpu")
_ALIGN = 16  # bytes: every packed tensor starts at an offset its dtype can be viewed at


class _Depth:
    """How deep inside a deliberate transfer the current code is (0: outside; the test mode reads it)."""

    def __init__(self) -> None:
        self.depth = 0
        self.calls = 0  # deliberate transfers begun (of host tensors too: the test mode tells them apart)
        self.transfers = 0  # device-to-host copies made so far (each one sync on CUDA)


on_purpose = _Depth()


@contextmanager
def _transfer():
    on_purpose.depth += 1
    on_purpose.calls += 1
    try:
        yield
    finally:
        on_purpose.depth -= 1


def fetch(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of ``tensors`` (same dtypes and shapes), brought over together: one sync on CUDA, none on the
    CPU (where the copy is a plain one). The copies share one buffer and never change when the originals do."""
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for device, which in by_device.items():
        for i, copy in zip(which, _fetch_one_device([tensors[i] for i in which], device)):
            out[i] = copy
    return out  # type: ignore[return-value]


def _fetch_one_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    if device.type == HOST.type:  # already on the host: a copy of each, nothing to pack, no sync
        with _transfer():
            return [t.clone(memory_format=torch.contiguous_format) for t in tensors]
    packed, places = pack(tensors)
    with _transfer():
        landed = torch.empty(packed.numel(), dtype=torch.uint8, pin_memory=device.type == "cuda")
        landed.copy_(packed, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the one wait
        on_purpose.transfers += 1
    return unpack(landed, places)


def pack(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple]]:
    """``tensors`` (one device, any dtypes and shapes) as one uint8 buffer on that device, each at an aligned
    offset, and where each one lies in it (for :func:`unpack`)."""
    chunks, places, offset = [], [], 0
    for t in tensors:
        pad = -offset % _ALIGN
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=t.device))
            offset += pad
        raw = t.contiguous().reshape(-1).view(torch.uint8)
        chunks.append(raw)
        places.append((offset, raw.numel(), t.dtype, tuple(t.shape)))
        offset += raw.numel()
    return torch.cat(chunks), places


def unpack(buffer: torch.Tensor, places: list[tuple]) -> list[torch.Tensor]:
    """The tensors :func:`pack` packed, as views of ``buffer``."""
    return [buffer[o: o + n].view(dtype).view(shape) for o, n, dtype, shape in places]


def values(t: torch.Tensor) -> list:
    """``t.tolist()`` through :func:`fetch`: the Python numbers a computation needs mid-pass (one sync on CUDA)."""
    (host,) = fetch([t])
    with _transfer():
        return host.tolist()


def upload(data, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``data`` (nested lists of numbers, or a tensor) as a tensor on ``device`` without a sync: on CUDA copied from
    pinned host memory without blocking (the stream orders it before the kernels that read it; the pinned block is
    not reused before the copy ran). A tensor already on ``device`` is returned as it is (cast to ``dtype``)."""
    device = torch.device(device)
    t = torch.as_tensor(data, dtype=dtype) if not isinstance(data, torch.Tensor) else data
    if isinstance(data, torch.Tensor) and t.device.type == device.type and dtype is not None:
        t = t.to(dtype)
    if t.device.type == device.type:
        return t.to(device, non_blocking=True)  # the same device: no copy (non_blocking: the test mode's marker)
    if device.type == "cuda":
        t = t.to(dtype) if dtype is not None else t
        t = t.pin_memory()
    return t.to(device, dtype=dtype, non_blocking=True)
