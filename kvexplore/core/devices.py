"""Which device a model or a cache goes to, checked: ``None`` is CUDA when there is one, else the CPU."""

from __future__ import annotations

import torch

from ..errors import SettingsError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means CUDA when there is one, else CPU."""
    if device is None:
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise SettingsError(f"device {device!r} is not a device torch knows ({e}); use 'cpu' or 'cuda'") from e
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingsError("device 'cuda' asked for but torch sees no CUDA device here; use device='cpu'")
        try:
            return torch.empty(0, device=device).device
        except (RuntimeError, AssertionError) as e:
            raise SettingsError(f"device {str(device)!r} cannot be used ({e}); torch sees "
                                f"{torch.cuda.device_count()} CUDA device(s): use 'cuda:0'") from e
    if device.type != "cpu":
        raise SettingsError(f"device type {device.type!r} is not supported; use 'cpu' or 'cuda'")
    return device
