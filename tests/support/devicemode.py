"""A pretend device on the CPU: which tensors would live on the GPU, and every host conversion of one.

On CUDA a tensor made from the model's weights or with ``device=...`` lives on the device, and converting it to
Python or NumPy (``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``int(t)``, ``if t:``) waits for the device.
Here every tensor is on the CPU, so :class:`DeviceTensor` marks the ones that would not be: the model's
parameters and buffers, tensors a factory makes with an explicit ``device=`` (or ``.to(device)``), and everything
computed from them. :class:`PretendDevice` is the mode that marks them and

- raises :class:`HostConversion` on a conversion of a device tensor outside :mod:`kvexplore.core.host` (which
  ``allow`` can widen for a test), naming the call;
- raises :class:`MixedDevices` when an operation mixes a device tensor with a host tensor of more than one
  element (CUDA refuses that: a missing ``.to(device)``);
- counts the deliberate transfers of device tensors (``transfers``) made through :mod:`kvexplore.core.host`;
- counts the blocking copies from the host to the device (``uploads``, with where each was made in ``upload_sites``):
  ``torch.tensor(data, device=...)``, ``.to(device)`` or ``copy_`` of a host tensor. CUDA copies pageable host
  memory synchronously, and its sync debug mode counts each one as a sync.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from kvexplore.core import host


class DeviceTensor(torch.Tensor):
    """A CPU tensor standing for one on the device (results of operations on it are device tensors too)."""


class HostConversion(AssertionError):
    pass


class MixedDevices(AssertionError):
    pass


_T = torch.Tensor
CONVERSIONS = {_T.item, _T.tolist, _T.numpy, _T.cpu, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
               _T.__complex__, _T.__array__, _T.__format__, _T.__repr__, _T.pin_memory}
FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.empty_strided}
# ops that accept a host index or a 0-d host scalar beside device tensors on CUDA
INDEXING = {_T.__getitem__, _T.__setitem__}


def is_device(t) -> bool:
    return isinstance(t, DeviceTensor)


def to_device(t: torch.Tensor) -> torch.Tensor:
    return t if is_device(t) else t.as_subclass(DeviceTensor)


def to_host(t):
    return t.as_subclass(torch.Tensor) if is_device(t) else t


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _wrap(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(_wrap(y, fn) for y in x)
    if isinstance(x, list):
        return [_wrap(y, fn) for y in x]
    return x


def _host_target(args, kwargs) -> bool | None:
    """For ``.to(...)``: True when it moves to the host (``"cpu"`` as a string or kvexplore.core.host.HOST), False when
    to a device, None when it changes only the dtype."""
    for a in (*args[1:], kwargs.get("device")):
        if a is None or isinstance(a, torch.dtype):
            continue
        if isinstance(a, torch.Tensor):
            return not is_device(a)
        if isinstance(a, str):
            return a == "cpu"
        if isinstance(a, torch.device):
            return a is host.HOST
    return None


class PretendDevice(TorchFunctionMode):
    """See the module's docstring. ``model`` gets its parameters and buffers marked as device tensors (restored
    on exit)."""

    def __init__(self, model: torch.nn.Module | None = None, allow: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.model, self.allow = model, allow
        self._saved: list = []

    def __enter__(self):
        if self.model is not None:
            for module in self.model.modules():
                for store in (module._parameters, module._buffers):
                    for name, t in store.items():
                        if t is not None:
                            self._saved.append((store, name, t))
                            if isinstance(t, torch.nn.Parameter):
                                store[name] = torch.nn.Parameter(to_device(t.data), requires_grad=False)
                            else:
                                store[name] = to_device(t)
        self._synced: set[int] = set()  # the kvexplore.core.host transfers a device tensor took part in
        self.upload_sites: list[str] = []  # where each blocking host-to-device copy was made
        self.allowed_sites: list[str] = []  # where each conversion ``allow`` let through was made
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for store, name, t in reversed(self._saved):
            store[name] = t
        self._saved = []
        return out

    @property
    def transfers(self) -> int:
        """Deliberate device-to-host transfers of device tensors since the mode began (each one sync on CUDA)."""
        return len(self._synced)

    @property
    def uploads(self) -> int:
        """Blocking host-to-device copies since the mode began (each one a sync on CUDA)."""
        return len(self.upload_sites)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inside = host.on_purpose.depth > 0
        device_in = [t for t in _tensors((args, kwargs)) if is_device(t)]
        if func in CONVERSIONS and device_in and not inside:
            if self._allowed():
                self.allowed_sites.append(self._where())  # a sync on CUDA all the same: counted
            else:
                raise HostConversion(f"{getattr(func, '__qualname__', func)} of a device tensor outside "
                                     f"kvexplore.core.host (a sync on CUDA): {self._where()}")
        if device_in and func not in INDEXING and not inside:
            host_in = [t for t in _tensors((args, kwargs)) if not is_device(t) and t.numel() > 1]
            if host_in:
                raise MixedDevices(f"{getattr(func, '__qualname__', func)} mixes device tensors with a host tensor of "
                                   f"shape {tuple(host_in[0].shape)} (CUDA refuses it): {self._where()}")
        out = func(*args, **kwargs)
        if inside:  # what kvexplore.core.host makes lands on the host
            if device_in:
                self._synced.add(host.on_purpose.calls)
            return _wrap(out, to_host)
        if func in FACTORIES and kwargs.get("device") is not None and kwargs["device"] is not host.HOST and \
                kwargs["device"] != "cpu":
            if func in (torch.tensor, torch.as_tensor) and not device_in:  # data from the host
                self.upload_sites.append(self._where())
            return _wrap(out, to_device)
        if func is _T.copy_ and is_device(args[0]) and not is_device(args[1]) and not kwargs.get("non_blocking") \
                and not inside:
            self.upload_sites.append(self._where())
        if func is _T.to and device_in:
            target = _host_target(args, kwargs)
            if target:
                if not self._allowed():
                    raise HostConversion(f"Tensor.to(host) of a device tensor outside kvexplore.core.host: "
                                         f"{self._where()}")
                return _wrap(out, to_host)
        elif func is _T.to and _host_target(args, kwargs) is False:
            if not kwargs.get("non_blocking"):
                self.upload_sites.append(self._where())
            return _wrap(out, to_device)
        return out

    def _allowed(self) -> bool:
        return bool(self.allow) and any(a in self._where() for a in self.allow)

    @staticmethod
    def _where() -> str:
        import traceback
        frames = [f for f in traceback.extract_stack() if "/kvexplore/" in f.filename and "/tests/" not in f.filename]
        return " <- ".join(f"{f.filename.split('/kvexplore/')[-1]}:{f.lineno} {f.name}" for f in frames[-1:-4:-1]) \
            or "outside kvexplore"
