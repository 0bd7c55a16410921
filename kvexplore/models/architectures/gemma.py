"""The Gemma family: Gemma 3 and Gemma 4 (text decoders).

Both add to the Llama layer q/k norms, sandwich norms, embeddings scaled by ``sqrt(hidden_size)``, GeGLU and
sliding layers with their own RoPE base; Gemma 4 also normalises values, scales each layer's output, gives its full
layers their own head size and lets its last ``num_kv_shared_layers`` layers read an earlier layer's cache (the
entries' traits and fields below). Gemma 3 GGUF files: :data:`GEMMA3_GGUF`.
"""

from __future__ import annotations

from typing import Any

from ...config.norms import FLOAT32_NORM, GEMMA_NORM
from ...config.config_fields import MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS
from ...config.config_json import every_nth
from ...config.families import Architecture, GGUFNames
from ...config.fields import BOOL, DICT, FLOAT, INT, Field, check, read
from ...errors import ConfigError, UnsupportedModelError
from .llama import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES

_COMMON = {"qk_norm": True, "sandwich_norms": True, "embed_scale": True}
_FIELDS = (Field("sliding_window_pattern", INT, 1, MAX_LAYERS), Field("rope_local_base_freq", FLOAT, 0, 1e12,
                                                                        lo_open=True))
GEMMA3_FIELDS = _FIELDS + (Field("query_pre_attn_scalar", FLOAT, 0, 1e9, lo_open=True),)
GEMMA4_FIELDS = _FIELDS + (
    Field("num_kv_shared_layers", INT, 0, MAX_LAYERS), Field("global_head_dim", INT, 1, MAX_HEAD_DIM),
    Field("num_global_key_value_heads", INT, 1, MAX_HEADS), Field("per_layer_config", DICT),
    Field("use_double_wide_mlp", BOOL))
_LAYER_FIELDS = (Field("head_dim", INT, 1, MAX_HEAD_DIM), Field("num_key_value_heads", INT, 1, MAX_HEADS))

# Gemma 4 options that do not touch the cache and that kvexplore does not implement: config key -> what it is
GEMMA4_REFUSED = {
    "hidden_size_per_layer_input": "per-layer input embeddings (PLE)",
    "enable_moe_block": "the mixture-of-experts block",
    "attention_k_eq_v": "keys used as values in full layers (attention_k_eq_v)",
    "use_bidirectional_attention": "bidirectional attention",
}


def _pattern(last_full: bool):
    """Without ``layer_types``: every ``sliding_window_pattern``-th layer (6th by default) full, the others slide."""
    def layer_types(v: dict[str, Any], window: int | None) -> list[str]:
        if window is None:
            return []
        return every_nth(v["num_hidden_layers"], v["sliding_window_pattern"] or 6, "sliding_attention", last_full)
    return layer_types


def _read_gemma3(v: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    return {"query_pre_attn_scalar": v["query_pre_attn_scalar"]}


def _read_gemma4(v: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    dims, heads = _per_layer_sizes(v, fields["layer_types"], where)
    return dict(num_kv_shared_layers=v["num_kv_shared_layers"] or 0, layer_head_dims=dims,
                layer_kv_head_counts=heads, double_wide_mlp=bool(v["use_double_wide_mlp"]))


def _per_layer_sizes(v: dict[str, Any], layer_types: list[str], where: str) -> tuple[dict[int, int], dict[int, int]]:
    """Layers whose head size or kv head count differ from the config's (Gemma 4's full layers): from
    ``global_head_dim`` or transformers' ``per_layer_config`` (``{"2": {"head_dim": 512}, ...}``)."""
    dims: dict[int, int] = {}
    heads: dict[int, int] = {}
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


def _refuse_gemma4(raw: dict[str, Any], where: str) -> None:
    """Gemma 4 options that kvexplore does not implement raise a clear error (they do not touch the cache)."""
    for key, what in GEMMA4_REFUSED.items():
        value = raw.get(key)
        if value not in (None, False, 0, "vision"):
            raise UnsupportedModelError(
                f"{where}: {key}={value!r} asks for {what}, which kvexplore does not implement for Gemma 4 (it does "
                f"not change the KV cache); set {key} to {0 if key == 'hidden_size_per_layer_input' else 'false'} "
                f"or null, or run the model in transformers")


def _gemma3_to_hf(config: Any) -> dict[str, Any]:
    """The Gemma 3 keys of ``config.json``: what the common writer leaves out (or writes as Llama's)."""
    local = config.rope_by_type.get("sliding_attention", {})
    scalar = config.query_pre_attn_scalar  # transformers wants an int where it is one (256, not 256.0)
    return {"hidden_act": config.hidden_act, "hidden_activation": config.hidden_act,
            "query_pre_attn_scalar": int(scalar) if scalar is not None and float(scalar).is_integer() else scalar,
            "layer_types": config.layer_types,
            "rope_local_base_freq": local.get("rope_theta", GEMMA3.local_theta),
            "attn_logit_softcapping": config.attn_logit_softcapping,
            "final_logit_softcapping": config.final_logit_softcapping}


#: Gemma 3's chat template (text turns; the model's own role is "model"), for GGUF files that carry none
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")

#: llama.cpp's ``gemma3`` files: Llama's names plus the q/k norms and the sandwich norms (its ``ffn_norm`` is the
#: norm before the MLP); norms stored as 1 + weight; the config keys llama.cpp supplies (transformers' defaults)
GEMMA3_GGUF = GGUFNames(
    "gemma3", False,
    {**GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
     "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
     "post_ffw_norm": "post_feedforward_layernorm"},
    GGUF_GLOBAL_NAMES, norm_shift=1.0,
    defaults={"query_pre_attn_scalar": 256, "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0},
    chat_template=GEMMA3_CHAT_TEMPLATE)

GEMMA3 = Architecture(
    "gemma3", "Gemma3ForCausalLM", "gemma3_text", "gemma", traits={**_COMMON, "norm_style": GEMMA_NORM},
    fields=GEMMA3_FIELDS, read=_read_gemma3, layer_types=_pattern(False), hidden_act="gelu_pytorch_tanh",
    default_theta=1e6, local_theta=1e4, to_hf=_gemma3_to_hf, transformers=("Gemma3TextConfig", "Gemma3ForCausalLM"),
    example={"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8, "sliding_window_pattern": 3},
    gguf=GEMMA3_GGUF)
GEMMA4 = Architecture(
    "gemma4", "Gemma4ForCausalLM", "gemma4_text", "gemma",
    traits={**_COMMON, "v_norm": True, "norm_style": FLOAT32_NORM, "layer_scalar": True,
            "unit_attention_scale": True},
    fields=GEMMA4_FIELDS, read=_read_gemma4, refuse=_refuse_gemma4, layer_types=_pattern(True),
    hidden_act="gelu_pytorch_tanh", default_theta=1e6, local_theta=1e4,
    transformers=("Gemma4TextConfig", "Gemma4ForCausalLM"),
    # output_hidden_states: transformers 5.24 crashes on multi-token passes with kv sharing and no per-layer
    # inputs unless hidden states are asked for (the logits are the same)
    example={"head_dim": 16, "global_head_dim": 32, "sliding_window": 8, "num_kv_shared_layers": 2,
             "num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + [
                 "sliding_attention"] * 2 + ["full_attention"],  # the shared layers 4, 5 read layers 3, 2
             "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 8, "final_logit_softcapping": 3.0,
             "output_hidden_states": True})

ARCHITECTURES = (GEMMA3, GEMMA4)
