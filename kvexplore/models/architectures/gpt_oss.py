"""gpt-oss: a Llama layer with learned attention sinks, biases on every projection, float32 norms, YaRN RoPE,
every second layer sliding, and a mixture of experts (:class:`~kvexplore.models.experts.MixtureOfExperts`) in
place of the MLP."""

from __future__ import annotations

from typing import Any

from ...config.norms import FLOAT32_NORM
from ...config.config_json import every_nth
from ...config.families import Architecture
from ...config.fields import FLOAT, INT, Field
from ..experts import MixtureOfExperts

FIELDS = (Field("num_local_experts", INT, 1, 4096), Field("num_experts", INT, 1, 4096),
          Field("num_experts_per_tok", INT, 1, 4096), Field("swiglu_alpha", FLOAT, 0, 1e6, lo_open=True),
          Field("swiglu_limit", FLOAT, 0, 1e9, lo_open=True))


def _read(v: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    bias = True if v["attention_bias"] is None else v["attention_bias"]  # biased projections unless told otherwise
    return dict(qkv_bias=bias, o_bias=bias, num_experts=v["num_local_experts"] or v["num_experts"] or 0,
                experts_per_token=v["num_experts_per_tok"] or 4,
                swiglu_alpha=1.702 if v["swiglu_alpha"] is None else v["swiglu_alpha"],
                swiglu_limit=7.0 if v["swiglu_limit"] is None else v["swiglu_limit"])


def _layer_types(v: dict[str, Any], window: int | None) -> list[str]:
    return every_nth(v["num_hidden_layers"], 2, "sliding_attention") if window is not None else []


GPT_OSS = Architecture(
    "gpt_oss", "GptOssForCausalLM", "gpt_oss", "gpt_oss",
    traits={"norm_style": FLOAT32_NORM, "attention_sinks": True}, fields=FIELDS, read=_read,
    layer_types=_layer_types, default_theta=150000.0, experts=MixtureOfExperts,
    transformers=("GptOssConfig", "GptOssForCausalLM"),
    example={"head_dim": 16, "sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2,
             "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 64,
                                 "rope_theta": 150000.0}})

ARCHITECTURES = (GPT_OSS,)
