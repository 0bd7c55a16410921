"""Reading a transformers ``config.json`` (v4 and v5 layouts) into the fields of a :class:`~.model_config.ModelConfig`:
what every architecture shares (:data:`COMMON_FIELDS`) here, what one adds or refuses by its registry entry."""

from __future__ import annotations

from typing import Any

from .config_fields import (LAYER_TYPE_NAMES, MAX_FFN, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS,
                            MAX_VOCAB)
from .families import Architecture, by_model_type, lookup, registered
from ..errors import ConfigError, UnsupportedModelError
from .fields import BOOL, DICT, FLOAT, IDS, INT, STR, STR_LIST, Field, check, read

# config.json: the fields every architecture reads, with their types and ranges (transformers v4 and v5 layouts)
COMMON_FIELDS = (
    Field("architectures", STR_LIST), Field("model_type", STR),
    Field("vocab_size", INT, 1, MAX_VOCAB, required=True),
    Field("hidden_size", INT, 1, MAX_HIDDEN, required=True),
    Field("intermediate_size", INT, 1, MAX_FFN, required=True),
    Field("num_hidden_layers", INT, 1, MAX_LAYERS, required=True),
    Field("num_attention_heads", INT, 1, MAX_HEADS, required=True),
    Field("num_key_value_heads", INT, 1, MAX_HEADS),
    Field("head_dim", INT, 1, MAX_HEAD_DIM),
    Field("rms_norm_eps", FLOAT, 0, 1, lo_open=True, hint="a small positive number such as 1e-5"),
    Field("rope_theta", FLOAT, 0, 1e12, lo_open=True, hint="the RoPE base, such as 10000"),
    Field("rope_scaling", DICT), Field("rope_parameters", DICT),
    Field("max_position_embeddings", INT, 1, MAX_POSITIONS),
    Field("tie_word_embeddings", BOOL), Field("attention_bias", BOOL), Field("mlp_bias", BOOL),
    Field("use_sliding_window", BOOL), Field("sliding_window", INT, 1, MAX_POSITIONS),
    Field("bos_token_id", INT, 0, MAX_VOCAB - 1), Field("eos_token_id", IDS, 0, MAX_VOCAB - 1),
    Field("torch_dtype", STR), Field("dtype", STR), Field("layer_types", STR_LIST),
    Field("hidden_activation", STR), Field("hidden_act", STR),
    Field("final_logit_softcapping", FLOAT, 0, 1e9, lo_open=True),
    Field("attn_logit_softcapping", FLOAT, 0, 1e9, lo_open=True),
    Field("partial_rotary_factor", FLOAT, 0, 1, lo_open=True),
)
_ROPE_THETA = Field("rope_parameters.rope_theta", FLOAT, 0, 1e12, lo_open=True, required=True)


def architecture_of(raw: dict[str, Any], where: str) -> Architecture:
    """The registered architecture ``config.json`` names (``architectures[0]``, else ``model_type``), or an
    UnsupportedModelError that lists the supported ones."""
    v = read(raw, COMMON_FIELDS[:2], where)
    archs = v["architectures"] or []
    found = lookup(archs[0]) if archs else by_model_type(v["model_type"])
    if found is None:
        name = archs[0] if archs else f"<model_type {v['model_type']!r}>"
        supported = ", ".join(a.hf_class for a in registered())
        raise UnsupportedModelError(f"{where}: architecture {name!r} is not supported; supported: {supported}")
    return found


def fields_from_hf(raw: dict[str, Any], where: str = "config.json", mla: str = "absorbed") -> dict[str, Any]:
    """The :class:`~.model_config.ModelConfig` fields of the parsed ``config.json`` of a transformers checkpoint (v4
    or v5 layout), each checked. ``mla``: how a latent-attention model (DeepSeek) reads its cache, ``"absorbed"``
    or ``"decompressed"``."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "the top level", type(raw).__name__, "a JSON object ({...})")
    arch = architecture_of(raw, where)
    if arch.aliases:  # the architecture's own names for common keys
        raw = {**raw, **{common: raw[own] for own, common in arch.aliases.items() if own in raw}}
    v = read(raw, COMMON_FIELDS + arch.fields, where)
    if arch.refuse is not None:
        arch.refuse(raw, where)
    rope_theta, rope_scaling, rope_by_type, fraction = _rope(v, arch, where)
    bias = v["attention_bias"]
    window = v["sliding_window"] if v["use_sliding_window"] is not False else None
    fields = dict(
        architecture=arch.hf_class,
        vocab_size=v["vocab_size"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_layers=v["num_hidden_layers"],
        num_heads=v["num_attention_heads"],
        num_kv_heads=v["num_key_value_heads"] or v["num_attention_heads"],
        head_dim=v["head_dim"] or 0,
        rms_norm_eps=1e-6 if v["rms_norm_eps"] is None else v["rms_norm_eps"],
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=v["max_position_embeddings"] or 2048,
        tie_word_embeddings=bool(v["tie_word_embeddings"]),
        qkv_bias=bool(bias),
        o_bias=bool(bias),
        mlp_bias=bool(v["mlp_bias"]),
        sliding_window=window,
        bos_token_id=v["bos_token_id"],
        eos_token_id=v["eos_token_id"] or [],
        torch_dtype=v["torch_dtype"] or v["dtype"],
        layer_types=_layer_types(v, arch, window),
        rope_by_type=rope_by_type,
        hidden_act=v["hidden_activation"] or v["hidden_act"] or arch.hidden_act,
        attn_logit_softcapping=v["attn_logit_softcapping"],
        final_logit_softcapping=v["final_logit_softcapping"],
        rotary_fraction=fraction or v["partial_rotary_factor"] or 1.0,
        mla=mla,
        source=where,
    )
    fields.update(arch.traits)  # switches the architecture always turns on
    if arch.read is not None:
        fields.update(arch.read(v, fields, where))
    return fields


def _rope(v: dict[str, Any], arch: Architecture,
          where: str) -> tuple[float, dict[str, Any] | None, dict[str, dict[str, Any]], float | None]:
    """``(rope_theta, rope_scaling, rope_by_type, partial_rotary_factor)`` from a v4 layout (``rope_theta``,
    ``rope_scaling``, the architecture's base for sliding layers) or a v5 one (one ``rope_parameters`` dict, or one
    per layer type)."""
    params = v["rope_parameters"] or {}
    if params and all(k in LAYER_TYPE_NAMES for k in params):  # v5, one entry per layer type
        by_type = {}
        for layer_type, entry in params.items():
            entry = dict(check(entry, Field(f"rope_parameters.{layer_type}", DICT, required=True), where))
            theta = check(entry.pop("rope_theta", None), _ROPE_THETA, where)
            by_type[layer_type] = {"rope_theta": theta, "rope_scaling": entry or None}
        full = by_type.get("full_attention") or next(iter(by_type.values()))
        return full["rope_theta"], full["rope_scaling"], by_type, None
    # transformers v5 moved rope_theta and rope_scaling into one "rope_parameters" dict
    rope = dict(params or v["rope_scaling"] or {})
    fraction = rope.pop("partial_rotary_factor", None) if rope.get("rope_type", "default") == "default" else None
    theta = v["rope_theta"]
    if "rope_theta" in rope:
        theta = check(rope.pop("rope_theta"), _ROPE_THETA, where)
    if theta is None:
        theta = arch.default_theta
    by_type = {}
    if arch.local_theta is not None:  # local layers: their own base and no scaling
        local = v.get("rope_local_base_freq")
        by_type["sliding_attention"] = {"rope_theta": arch.local_theta if local is None else local,
                                        "rope_scaling": None}
    if fraction is not None:  # Qwen3-Next: RoPE turns only the first part of each head
        fraction = check(fraction, Field("rope_parameters.partial_rotary_factor", FLOAT, 0, 1, lo_open=True), where)
    return theta, rope or None, by_type, fraction


def _layer_types(v: dict[str, Any], arch: Architecture, window: int | None) -> list[str]:
    """Each layer's attention type: ``layer_types`` when given, else the architecture's default (Gemma's every n-th
    layer full, Qwen3-Next's every n-th layer attention), else [] (all sliding when a window is set, else all full)."""
    if v["layer_types"]:
        if window is None:  # Qwen3 lists layer types but turns the window off with use_sliding_window: false
            return ["full_attention" if t == "sliding_attention" else t for t in v["layer_types"]]
        return list(v["layer_types"])
    return arch.layer_types(v, window) if arch.layer_types is not None else []


def every_nth(num_layers: int, every: int, others: str, last_full: bool = False) -> list[str]:
    """Layer types where every ``every``-th layer is full attention and the others are ``others`` (optionally the
    last layer full too): the layer plans of Gemma, gpt-oss and Qwen3-Next."""
    types = ["full_attention" if (i + 1) % every == 0 else others for i in range(num_layers)]
    if last_full:
        types[-1] = "full_attention"
    return types
