"""Reading a transformers ``config.json`` (v4 and v5 layouts) into the fields of a :class:`~.config.ModelConfig`:
every field kvexplore reads, checked, and what each architecture adds or refuses."""

from __future__ import annotations

import dataclasses
from typing import Any

from .architectures import ARCHITECTURES, GEMMA4_REFUSED, MODEL_TYPES, default_layer_types
from .config_fields import (LAYER_TYPE_NAMES, MAX_FFN, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS,
                            MAX_VOCAB, SUPPORTED_ARCHITECTURES)
from ..errors import ConfigError, UnsupportedModelError
from .fields import BOOL, DICT, FLOAT, IDS, INT, STR, STR_LIST, Field, check, read

# config.json: every field kvexplore reads, with its type and range (transformers v4 and v5 layouts)
CONFIG_FIELDS = (
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
    Field("torch_dtype", STR), Field("dtype", STR),
    Field("layer_types", STR_LIST), Field("sliding_window_pattern", INT, 1, MAX_LAYERS),
    Field("query_pre_attn_scalar", FLOAT, 0, 1e9, lo_open=True), Field("rope_local_base_freq", FLOAT, 0, 1e12,
                                                                        lo_open=True),
    Field("hidden_activation", STR), Field("hidden_act", STR),
    Field("final_logit_softcapping", FLOAT, 0, 1e9, lo_open=True),
    Field("attn_logit_softcapping", FLOAT, 0, 1e9, lo_open=True),
    # gpt-oss's experts
    Field("num_local_experts", INT, 1, 4096), Field("num_experts", INT, 1, 4096),
    Field("num_experts_per_tok", INT, 1, 4096), Field("swiglu_alpha", FLOAT, 0, 1e6, lo_open=True),
    Field("swiglu_limit", FLOAT, 0, 1e9, lo_open=True),
    # Gemma 4's shared layers and per-layer sizes
    Field("num_kv_shared_layers", INT, 0, MAX_LAYERS), Field("global_head_dim", INT, 1, MAX_HEAD_DIM),
    Field("num_global_key_value_heads", INT, 1, MAX_HEADS), Field("per_layer_config", DICT),
    Field("use_double_wide_mlp", BOOL),
    # DeepSeek's latent attention and its experts
    Field("kv_lora_rank", INT, 1, MAX_HIDDEN), Field("q_lora_rank", INT, 1, MAX_HIDDEN),
    Field("qk_nope_head_dim", INT, 1, MAX_HEAD_DIM), Field("qk_rope_head_dim", INT, 2, MAX_HEAD_DIM),
    Field("v_head_dim", INT, 1, MAX_HEAD_DIM), Field("rope_interleave", BOOL),
    Field("n_routed_experts", INT, 1, 4096), Field("n_shared_experts", INT, 0, 4096), Field("n_group", INT, 1, 4096),
    Field("topk_group", INT, 1, 4096), Field("routed_scaling_factor", FLOAT, 0, 1e6, lo_open=True),
    Field("norm_topk_prob", BOOL), Field("first_k_dense_replace", INT, 0, MAX_LAYERS),
    Field("moe_intermediate_size", INT, 1, MAX_FFN),
    # Qwen3-Next's linear-attention (gated DeltaNet) layers and its experts
    Field("linear_num_key_heads", INT, 1, MAX_HEADS), Field("linear_num_value_heads", INT, 1, MAX_HEADS),
    Field("linear_key_head_dim", INT, 1, MAX_HEAD_DIM), Field("linear_value_head_dim", INT, 1, MAX_HEAD_DIM),
    Field("linear_conv_kernel_dim", INT, 1, 64), Field("shared_expert_intermediate_size", INT, 0, MAX_FFN),
    Field("decoder_sparse_step", INT, 1, MAX_LAYERS), Field("mlp_only_layers", IDS, 0, MAX_LAYERS - 1),
    Field("full_attention_interval", INT, 1, MAX_LAYERS), Field("partial_rotary_factor", FLOAT, 0, 1, lo_open=True),
    # DeepSeek-V3.2's lightning indexer
    Field("index_topk", INT, 1, MAX_POSITIONS), Field("index_head_dim", INT, 2, MAX_HEAD_DIM),
    Field("index_n_heads", INT, 1, MAX_HEADS),
)
_LAYER_FIELDS = (Field("head_dim", INT, 1, MAX_HEAD_DIM), Field("num_key_value_heads", INT, 1, MAX_HEADS))
_ROPE_THETA = Field("rope_parameters.rope_theta", FLOAT, 0, 1e12, lo_open=True, required=True)


def fields_from_hf(raw: dict[str, Any], where: str = "config.json", mla: str = "absorbed") -> dict[str, Any]:
    """The :class:`~.config.ModelConfig` fields of the parsed ``config.json`` of a transformers checkpoint (v4 or v5
    layout), each checked. ``mla``: how a latent-attention model (DeepSeek) reads its cache, ``"absorbed"`` or
    ``"decompressed"``."""
    if not isinstance(raw, dict):
        raise ConfigError(where, "the top level", type(raw).__name__, "a JSON object ({...})")
    v = read(raw, CONFIG_FIELDS, where)
    archs = v["architectures"] or []
    arch = archs[0] if archs else _arch_from_model_type(v["model_type"])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{where}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    traits = ARCHITECTURES[arch]
    _refuse_options(raw, arch, where)
    rope_theta, rope_scaling, rope_by_type, fraction = _rope(v, arch, where)
    eos = v["eos_token_id"]
    bias = bool(v["attention_bias"]) if v["attention_bias"] is not None else traits.attention_sinks
    window = v["sliding_window"] if v["use_sliding_window"] is not False else None
    layer_types = _layer_types(v, arch, window)
    head_dims, kv_heads = _per_layer_sizes(v, layer_types, arch, where)
    experts = v["num_local_experts"] or v["num_experts"] or v["n_routed_experts"] or 0
    latent, next_ = traits.latent_attention, traits.gated_attention
    rotary_fraction = fraction or v["partial_rotary_factor"] or 1.0
    dense = (v["first_k_dense_replace"] or 0) if latent else 0
    return dict(
        architecture=arch,
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
        qkv_bias=traits.qkv_bias or bias,
        o_bias=bias,
        mlp_bias=bool(v["mlp_bias"]),
        sliding_window=window,
        bos_token_id=v["bos_token_id"],
        eos_token_id=eos or [],
        torch_dtype=v["torch_dtype"] or v["dtype"],
        layer_types=layer_types,
        num_kv_shared_layers=v["num_kv_shared_layers"] or 0,
        rope_by_type=rope_by_type,
        layer_head_dims=head_dims,
        layer_kv_head_counts=kv_heads,
        qk_norm=traits.qk_norm,
        v_norm=traits.v_norm,
        norm_style=traits.norm,
        sandwich_norms=traits.sandwich_norms,
        embed_scale=traits.embed_scale,
        hidden_act=v["hidden_activation"] or v["hidden_act"] or traits.hidden_act,
        query_pre_attn_scalar=v["query_pre_attn_scalar"] if traits.query_pre_attn_scalar else None,
        unit_attention_scale=traits.unit_attention_scale,
        attn_logit_softcapping=v["attn_logit_softcapping"],
        final_logit_softcapping=v["final_logit_softcapping"],
        attention_sinks=traits.attention_sinks,
        layer_scalar=traits.layer_scalar,
        num_experts=experts if traits.mixture_of_experts or latent or next_ else 0,
        experts_per_token=(v["num_experts_per_tok"] or 4) if traits.mixture_of_experts or latent or next_ else 0,
        swiglu_alpha=1.702 if v["swiglu_alpha"] is None else v["swiglu_alpha"],
        swiglu_limit=7.0 if v["swiglu_limit"] is None else v["swiglu_limit"],
        double_wide_mlp=bool(v["use_double_wide_mlp"]),
        kv_lora_rank=(v["kv_lora_rank"] or 0) if latent else 0,
        q_lora_rank=(v["q_lora_rank"] or 0) if latent else 0,
        qk_nope_head_dim=(v["qk_nope_head_dim"] or 0) if latent else 0,
        qk_rope_head_dim=(v["qk_rope_head_dim"] or 0) if latent else 0,
        v_head_dim=(v["v_head_dim"] or 0) if latent else 0,
        rope_interleave=(v["rope_interleave"] is not False) if latent else False,  # V3.2: always interleaved
        index_topk=(v["index_topk"] or 0) if arch == "DeepseekV32ForCausalLM" else 0,
        index_heads=(v["index_n_heads"] or 0) if arch == "DeepseekV32ForCausalLM" else 0,
        index_head_dim=(v["index_head_dim"] or 0) if arch == "DeepseekV32ForCausalLM" else 0,
        mla=mla,
        shared_experts=(v["n_shared_experts"] or 0) if latent else 0,
        expert_groups=(v["n_group"] or 1) if latent else 1,
        groups_per_token=(v["topk_group"] or 1) if latent else 1,
        routed_scaling_factor=1.0 if v["routed_scaling_factor"] is None else v["routed_scaling_factor"],
        norm_topk_prob=v["norm_topk_prob"] is not False,
        first_dense_layers=dense,
        moe_intermediate_size=(v["moe_intermediate_size"] or 0) if latent or next_ else 0,
        linear_key_heads=v["linear_num_key_heads"] or 0,
        linear_value_heads=v["linear_num_value_heads"] or 0,
        linear_key_dim=v["linear_key_head_dim"] or 0,
        linear_value_dim=v["linear_value_head_dim"] or 0,
        conv_kernel=v["linear_conv_kernel_dim"] or 0,
        gated_attention=traits.gated_attention,
        rotary_fraction=rotary_fraction,
        shared_expert_size=v["shared_expert_intermediate_size"] or 0,
        dense_layers=sorted({*(v["mlp_only_layers"] or []), *(
            i for i in range(v["num_hidden_layers"]) if (i + 1) % (v["decoder_sparse_step"] or 1))}),
        source=where,
    )


def _refuse_options(raw: dict[str, Any], arch: str, where: str) -> None:
    """Gemma 4 options that kvexplore does not implement raise a clear error (they do not touch the cache)."""
    if arch != "Gemma4ForCausalLM":
        return
    for key, what in GEMMA4_REFUSED.items():
        value = raw.get(key)
        if value not in (None, False, 0, "vision"):
            raise UnsupportedModelError(
                f"{where}: {key}={value!r} asks for {what}, which kvexplore does not implement for Gemma 4 (it does "
                f"not change the KV cache); set {key} to {0 if key == 'hidden_size_per_layer_input' else 'false'} "
                f"or null, or run the model in transformers")


def _per_layer_sizes(v: dict[str, Any], layer_types: list[str], arch: str,
                     where: str) -> tuple[dict[int, int], dict[int, int]]:
    """Layers whose head size or kv head count differ from the config's (Gemma 4's full layers): from
    ``global_head_dim`` or transformers' ``per_layer_config`` (``{"2": {"head_dim": 512}, ...}``)."""
    dims: dict[int, int] = {}
    heads: dict[int, int] = {}
    if arch != "Gemma4ForCausalLM":
        return dims, heads
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
    for key, entry in (v["per_layer_config"] or {}).items():
        if not (isinstance(key, str) and key.isdigit()):
            raise ConfigError(where, "per_layer_config", key, "layer numbers as keys (\"0\", \"1\", ...)")
        got = read(check(entry, Field(f"per_layer_config.{key}", DICT, required=True), where), _LAYER_FIELDS,
                   f"{where} (per_layer_config.{key})")
        if got["head_dim"] is not None:
            dims[int(key)] = got["head_dim"]
        if got["num_key_value_heads"] is not None:
            heads[int(key)] = got["num_key_value_heads"]
    if not dims:  # transformers' default for Gemma 4 full layers when the config names none: 512
        dims = {i: v["global_head_dim"] or 512 for i in full}
    return dims, heads


def _rope(v: dict[str, Any], arch: str,
          where: str) -> tuple[float, dict[str, Any] | None, dict[str, dict[str, Any]], float | None]:
    """``(rope_theta, rope_scaling, rope_by_type, partial_rotary_factor)`` from a v4 layout (``rope_theta``,
    ``rope_scaling``, Gemma 3's ``rope_local_base_freq``) or a v5 one (one ``rope_parameters`` dict, or one per
    layer type)."""
    params = v["rope_parameters"] or {}
    if params and all(k in LAYER_TYPE_NAMES for k in params):  # v5, one entry per layer type
        by_type = {}
        for kind, entry in params.items():
            entry = dict(check(entry, Field(f"rope_parameters.{kind}", DICT, required=True), where))
            theta = check(entry.pop("rope_theta", None), _ROPE_THETA, where)
            by_type[kind] = {"rope_theta": theta, "rope_scaling": entry or None}
        full = by_type.get("full_attention") or next(iter(by_type.values()))
        return full["rope_theta"], full["rope_scaling"], by_type, None
    # transformers v5 moved rope_theta and rope_scaling into one "rope_parameters" dict
    rope = dict(params or v["rope_scaling"] or {})
    fraction = rope.pop("partial_rotary_factor", None) if rope.get("rope_type", "default") == "default" else None
    theta = v["rope_theta"]
    if "rope_theta" in rope:
        theta = check(rope.pop("rope_theta"), _ROPE_THETA, where)
    traits = ARCHITECTURES[arch]
    if theta is None:
        theta = traits.default_theta
    by_type = {}
    if traits.local_theta is not None:  # local layers: their own base and no scaling
        local = v["rope_local_base_freq"]
        by_type["sliding_attention"] = {"rope_theta": traits.local_theta if local is None else local,
                                        "rope_scaling": None}
    if fraction is not None:  # Qwen3-Next: RoPE turns only the first part of each head
        fraction = check(fraction, Field("rope_parameters.partial_rotary_factor", FLOAT, 0, 1, lo_open=True), where)
    return theta, rope or None, by_type, fraction


def _layer_types(v: dict[str, Any], arch: str, window: int | None) -> list[str]:
    """Each layer's attention type: ``layer_types`` when given, else Gemma 3's ``sliding_window_pattern`` (every
    n-th layer full), else all sliding when a window is set (Mistral), else all full."""
    if v["layer_types"]:
        if window is None:  # Qwen3 lists layer types but turns the window off with use_sliding_window: false
            return ["full_attention" if t == "sliding_attention" else t for t in v["layer_types"]]
        return list(v["layer_types"])
    if arch == "Qwen3NextForCausalLM":  # every full_attention_interval-th layer attends, the others are linear
        every = v["full_attention_interval"] or 4
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(v["num_hidden_layers"])]
    traits = ARCHITECTURES[arch]
    if traits.pattern is not None and window is not None:
        if v["sliding_window_pattern"]:
            traits = dataclasses.replace(traits, pattern=v["sliding_window_pattern"])
        return default_layer_types(traits, v["num_hidden_layers"])
    return []


def _arch_from_model_type(model_type: str | None) -> str:
    return MODEL_TYPES.get(model_type or "", f"<model_type {model_type!r}>")
