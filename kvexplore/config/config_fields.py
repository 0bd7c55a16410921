"""What a model config may hold, checked: the plausibility bounds, the supported names and the RoPE scalings.
Shared by the config.json reader (:mod:`.config_json`), the GGUF reader and :class:`~.config.ModelConfig`."""

from __future__ import annotations

import math
from typing import Any

from ..errors import ConfigError, UnsupportedModelError
from .fields import BOOL, FLOAT, INT, Field, read

LAYER_TYPE_NAMES = ("full_attention", "sliding_attention", "linear_attention", "indexed_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# plausibility bounds: past these a config is damaged (the largest released models are far inside them), and
# sizes this large would make the loader build millions of names or allocate terabytes before failing
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 1024, 1024, 2048
MAX_HIDDEN, MAX_FFN, MAX_VOCAB, MAX_POSITIONS = 1 << 16, 1 << 20, 1 << 22, 1 << 30

# rope_scaling / rope_parameters entries, by scaling type (None: plain RoPE, nothing to read)
ROPE_FIELDS: dict[str, tuple[Field, ...] | None] = {
    "default": None,
    "linear": (Field("factor", FLOAT, 0, 1e6, required=True, lo_open=True),),
    "llama3": (Field("factor", FLOAT, 0, 1e6, required=True, lo_open=True),
               Field("low_freq_factor", FLOAT, 0, 1e6, required=True, lo_open=True),
               Field("high_freq_factor", FLOAT, 0, 1e6, required=True, lo_open=True),
               Field("original_max_position_embeddings", INT, 1, MAX_POSITIONS)),
    "yarn": (Field("factor", FLOAT, 0, 1e6, required=True, lo_open=True), Field("beta_fast", FLOAT, 0, 1e6),
             Field("beta_slow", FLOAT, 0, 1e6), Field("original_max_position_embeddings", INT, 1, MAX_POSITIONS),
             Field("truncate", BOOL), Field("attention_factor", FLOAT, 0, 1e6, lo_open=True),
             Field("mscale", FLOAT, 0, 1e6), Field("mscale_all_dim", FLOAT, 0, 1e6)),
    "proportional": (Field("partial_rotary_factor", FLOAT, 0, 1), Field("factor", FLOAT, 0, 1e6, lo_open=True)),
}
SUPPORTED_ROPE_TYPES = tuple(ROPE_FIELDS)


def _check_llama3(values: dict[str, Any], where: str) -> None:
    if values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ConfigError(where, "rope_scaling.high_freq_factor", values["high_freq_factor"],
                          f"more than low_freq_factor ({values['low_freq_factor']})")


# checks across the numbers of one scaling type, beyond each number's own range
_ROPE_CHECKS = {"llama3": _check_llama3}


def checked_rope_scaling(rope: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """``rope`` (without ``rope_theta``) checked for its type: ``None`` for plain RoPE, else a dict with
    ``rope_type`` and the numbers that type needs, each checked."""
    if not rope:
        return None
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(rope_type, str):
        raise ConfigError(where, "rope_scaling.rope_type", rope_type, f"one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type not in ROPE_FIELDS:
        raise UnsupportedModelError(
            f"{where}: rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    fields = ROPE_FIELDS[rope_type]
    if fields is None:
        return None
    values = read(rope, fields, f"{where} (rope_scaling)")
    if rope_type in _ROPE_CHECKS:
        _ROPE_CHECKS[rope_type](values, where)
    return {**rope, **{k: v for k, v in values.items() if v is not None}, "rope_type": rope_type}


def mscale_all_dim(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's correction of the softmax scale under YaRN: ``0.1 * mscale_all_dim * ln(factor) + 1``."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0
