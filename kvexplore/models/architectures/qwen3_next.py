"""Qwen3-Next: three gated DeltaNet layers (:class:`~kvexplore.models.deltanet.GatedDeltaNet`, a fixed-size
recurrent state per layer, ``linear_attention``) to one attention layer (``full_attention_interval``); attention
with a per-head output gate and RoPE over the first ``partial_rotary_factor`` of each head; ``1 + weight`` norms;
experts with one shared expert (:class:`~kvexplore.models.experts.SharedExpertMoE`) except in ``mlp_only_layers``.
"""

from __future__ import annotations

from typing import Any

from ...config.norms import GEMMA_NORM
from ...config.config_fields import MAX_FFN, MAX_HEAD_DIM, MAX_HEADS, MAX_LAYERS
from ...config.config_json import every_nth
from ...config.families import Architecture
from ...config.fields import BOOL, IDS, INT, Field
from ...errors import ConfigError
from ..deltanet import GatedDeltaNet
from ..experts import SharedExpertMoE

FIELDS = (
    Field("linear_num_key_heads", INT, 1, MAX_HEADS), Field("linear_num_value_heads", INT, 1, MAX_HEADS),
    Field("linear_key_head_dim", INT, 1, MAX_HEAD_DIM), Field("linear_value_head_dim", INT, 1, MAX_HEAD_DIM),
    Field("linear_conv_kernel_dim", INT, 1, 64), Field("shared_expert_intermediate_size", INT, 0, MAX_FFN),
    Field("decoder_sparse_step", INT, 1, MAX_LAYERS), Field("mlp_only_layers", IDS, 0, MAX_LAYERS - 1),
    Field("full_attention_interval", INT, 1, MAX_LAYERS), Field("num_experts", INT, 1, 4096),
    Field("num_experts_per_tok", INT, 1, 4096), Field("moe_intermediate_size", INT, 1, MAX_FFN),
    Field("norm_topk_prob", BOOL),
)


def _read(v: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    every = v["decoder_sparse_step"] or 1
    return dict(
        num_experts=v["num_experts"] or 0, experts_per_token=v["num_experts_per_tok"] or 4,
        moe_intermediate_size=v["moe_intermediate_size"] or 0, norm_topk_prob=v["norm_topk_prob"] is not False,
        linear_key_heads=v["linear_num_key_heads"] or 0, linear_value_heads=v["linear_num_value_heads"] or 0,
        linear_key_dim=v["linear_key_head_dim"] or 0, linear_value_dim=v["linear_value_head_dim"] or 0,
        conv_kernel=v["linear_conv_kernel_dim"] or 0, shared_expert_size=v["shared_expert_intermediate_size"] or 0,
        dense_layers=sorted({*(v["mlp_only_layers"] or []),
                             *(i for i in range(v["num_hidden_layers"]) if (i + 1) % every)}))


def _layer_types(v: dict[str, Any], window: int | None) -> list[str]:
    """Every ``full_attention_interval``-th layer (4th by default) attends, the others are linear."""
    return every_nth(v["num_hidden_layers"], v["full_attention_interval"] or 4, "linear_attention")


def check_linear(c: Any, where: str) -> None:
    """A linear-attention layer's sizes: positive, value heads a multiple of key heads."""
    if "linear_attention" not in c.layer_types:
        return
    for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "conv_kernel"):
        if getattr(c, name) < 1:
            raise ConfigError(where, name, getattr(c, name), "a positive size (linear attention needs it)")
    if c.linear_value_heads % c.linear_key_heads:
        raise ConfigError(where, "linear_num_value_heads", c.linear_value_heads,
                          f"a multiple of linear_num_key_heads ({c.linear_key_heads})")


QWEN3_NEXT = Architecture(
    "qwen3_next", "Qwen3NextForCausalLM", "qwen3_next", "qwen3_next",
    traits={"qk_norm": True, "norm_style": GEMMA_NORM, "gated_attention": True}, fields=FIELDS, read=_read,
    layer_types=_layer_types, check=check_linear, recurrent=GatedDeltaNet, experts=SharedExpertMoE,
    transformers=("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    example={"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48, "mlp_only_layers": [1],
             "num_hidden_layers": 4,
             "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
             "partial_rotary_factor": 0.25})

ARCHITECTURES = (QWEN3_NEXT,)
