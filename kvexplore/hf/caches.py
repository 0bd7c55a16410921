"""transformers' own cache classes by name, made for one model: what ``hf:<name>`` lanes and the doctor run."""

from __future__ import annotations

import importlib.util
from typing import Any

from ..errors import SettingsError

# name -> what it is; "quantized" is transformers' QuantizedCache with its fp8 backend (no extra package),
# "quantized-quanto" / "quantized-hqq" need optimum-quanto / hqq, "offloaded" a CUDA device
HF_CACHES = {
    "dynamic": "DynamicCache(config=...): layers grow by torch.cat; sliding layers keep their window",
    "static": "StaticCache(config, max_cache_len): allocated once, written in place",
    "offloaded": "DynamicCache(config, offloading=True): layers wait on the CPU between uses (CUDA only)",
    "quantized": "QuantizedCache('fp8', config): keys and values stored in float8 (full-attention models)",
    "quantized-quanto": "QuantizedCache('quanto', config): int4 with a residual (needs optimum-quanto)",
    "quantized-hqq": "QuantizedCache('hqq', config): int4 with a residual (needs hqq)",
}
NEEDS = {"quantized-quanto": "optimum.quanto", "quantized-hqq": "hqq"}
BOUNDED = {"static"}  # the transformers caches sized by max_seq_len (the others grow)


def is_transformers(obj: Any, base: str) -> bool:
    """Whether ``obj`` is an instance of transformers' class named ``base`` (any subclass, one's own too), without
    importing transformers when it is not loaded."""
    return any(c.__module__.startswith("transformers.") and c.__name__ == base for c in type(obj).__mro__)


def is_hf_cache(obj: Any) -> bool:
    """Whether ``obj`` is a transformers ``Cache`` (of any class, one's own subclass too)."""
    return is_transformers(obj, "Cache")


def available(name: str, device_type: str = "cpu") -> str | None:
    """None if ``hf:name`` can run here, else why not."""
    if name not in HF_CACHES:
        return f"unknown transformers cache {name!r}; available: {', '.join(HF_CACHES)}"
    if name == "offloaded" and device_type != "cuda":
        return "the offloaded cache moves layers between a CUDA device and the CPU: load the model on CUDA"
    module = NEEDS.get(name)
    if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
        return (f"{name} needs {module.split('.')[0].replace('optimum', 'optimum-quanto')}: pip install it, or use "
                f"'quantized' (fp8)")
    return None


def make_hf_cache(name: str, hf_module, max_seq_len: int):
    """A fresh transformers cache of kind ``name`` for ``hf_module``."""
    import transformers

    if why := available(name, next(hf_module.parameters()).device.type):
        raise SettingsError(why)
    config = hf_module.config
    if name == "dynamic":
        return transformers.DynamicCache(config=config)
    if name == "static":
        return transformers.StaticCache(config=config, max_cache_len=max_seq_len)
    if name == "offloaded":
        return transformers.DynamicCache(config=config, offloading=True)
    backend = name.split("-")[1] if "-" in name else "fp8"
    try:
        return transformers.QuantizedCache(backend, config=config)
    except ValueError as e:
        raise SettingsError(f"transformers' quantized cache refuses this model ({e}); use hf:dynamic or "
                            f"hf:static") from e
