"""The DeepSeek family: DeepSeek-V3 and V3.2.

Multi-head latent attention (:class:`~kvexplore.models.latent.LatentAttention`): each layer caches one latent of
``kv_lora_rank`` and one rope key of ``qk_rope_head_dim`` per position (a ``latent`` layer in the plan); after the
first ``first_k_dense_replace`` dense layers, routed and shared experts
(:class:`~kvexplore.models.experts.DeepseekExperts`). V3.2 adds a lightning indexer (``index_*``) that picks the
``index_topk`` positions each query reads.
"""

from __future__ import annotations

from typing import Any

from ...config.norms import FLOAT32_NORM
from ...config.config_fields import MAX_FFN, MAX_HEAD_DIM, MAX_HEADS, MAX_HIDDEN, MAX_LAYERS, MAX_POSITIONS
from ...config.families import Architecture
from ...config.fields import BOOL, FLOAT, INT, Field
from ...errors import ConfigError
from ..experts import DeepseekExperts
from ..latent import LatentAttention

FIELDS = (
    Field("kv_lora_rank", INT, 1, MAX_HIDDEN), Field("q_lora_rank", INT, 1, MAX_HIDDEN),
    Field("qk_nope_head_dim", INT, 1, MAX_HEAD_DIM), Field("qk_rope_head_dim", INT, 2, MAX_HEAD_DIM),
    Field("v_head_dim", INT, 1, MAX_HEAD_DIM), Field("rope_interleave", BOOL),
    Field("n_routed_experts", INT, 1, 4096), Field("n_shared_experts", INT, 0, 4096), Field("n_group", INT, 1, 4096),
    Field("topk_group", INT, 1, 4096), Field("num_experts_per_tok", INT, 1, 4096),
    Field("routed_scaling_factor", FLOAT, 0, 1e6, lo_open=True), Field("norm_topk_prob", BOOL),
    Field("first_k_dense_replace", INT, 0, MAX_LAYERS), Field("moe_intermediate_size", INT, 1, MAX_FFN),
)
INDEXER_FIELDS = (Field("index_topk", INT, 1, MAX_POSITIONS), Field("index_head_dim", INT, 2, MAX_HEAD_DIM),
                  Field("index_n_heads", INT, 1, MAX_HEADS))


def _read(v: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    return dict(
        num_experts=v["n_routed_experts"] or 0, experts_per_token=v["num_experts_per_tok"] or 4,
        kv_lora_rank=v["kv_lora_rank"] or 0, q_lora_rank=v["q_lora_rank"] or 0,
        qk_nope_head_dim=v["qk_nope_head_dim"] or 0, qk_rope_head_dim=v["qk_rope_head_dim"] or 0,
        v_head_dim=v["v_head_dim"] or 0, rope_interleave=v["rope_interleave"] is not False,
        shared_experts=v["n_shared_experts"] or 0, expert_groups=v["n_group"] or 1,
        groups_per_token=v["topk_group"] or 1,
        routed_scaling_factor=1.0 if v["routed_scaling_factor"] is None else v["routed_scaling_factor"],
        norm_topk_prob=v["norm_topk_prob"] is not False, first_dense_layers=v["first_k_dense_replace"] or 0,
        moe_intermediate_size=v["moe_intermediate_size"] or 0)


def _read_v32(v: dict[str, Any], fields: dict[str, Any], where: str) -> dict[str, Any]:
    return dict(_read(v, fields, where), index_topk=v["index_topk"] or 0, index_heads=v["index_n_heads"] or 0,
                index_head_dim=v["index_head_dim"] or 0)


def check_latent(c: Any, where: str) -> None:
    """Latent attention's sizes: positive, an even rope part, an indexer that fits, expert groups that divide."""
    if not c.kv_lora_rank:
        return
    if c.mla not in ("absorbed", "decompressed"):
        raise ConfigError(where, "mla", c.mla, '"absorbed" or "decompressed"')
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(c, name) < 1:
            raise ConfigError(where, name, getattr(c, name), "a positive size (latent attention needs it)")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(where, "qk_rope_head_dim", c.qk_rope_head_dim, "an even number (RoPE turns pairs)")
    if c.index_topk and (c.index_heads < 1 or c.index_head_dim < c.qk_rope_head_dim or not c.q_lora_rank):
        raise ConfigError(where, "index_n_heads / index_head_dim", (c.index_heads, c.index_head_dim),
                          f"at least 1 head of at least qk_rope_head_dim ({c.qk_rope_head_dim}) channels, "
                          f"and a q_lora_rank (the indexer reads the compressed query)")
    if c.num_experts and (c.num_experts % c.expert_groups or not 1 <= c.groups_per_token <= c.expert_groups):
        raise ConfigError(where, "n_group / topk_group", (c.expert_groups, c.groups_per_token),
                          f"groups that divide n_routed_experts ({c.num_experts}), 1 <= topk_group <= n_group")


_EXAMPLE = {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4, "v_head_dim": 8, "n_routed_experts": 8, "n_shared_experts": 1, "n_group": 2,
            "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
            "routed_scaling_factor": 2.5}
_PARTS = dict(traits={"norm_style": FLOAT32_NORM}, check=check_latent, attention=LatentAttention,
              experts=DeepseekExperts)

DEEPSEEK_V3 = Architecture("deepseek_v3", "DeepseekV3ForCausalLM", "deepseek_v3", "deepseek", fields=FIELDS,
                           read=_read, transformers=("DeepseekV3Config", "DeepseekV3ForCausalLM"), example=_EXAMPLE,
                           **_PARTS)
DEEPSEEK_V32 = Architecture("deepseek_v32", "DeepseekV32ForCausalLM", "deepseek_v32", "deepseek",
                            fields=FIELDS + INDEXER_FIELDS, read=_read_v32,
                            transformers=("DeepseekV32Config", "DeepseekV32ForCausalLM"),
                            example={**_EXAMPLE, "index_topk": 8, "index_n_heads": 32, "index_head_dim": 16},
                            **_PARTS)

ARCHITECTURES = (DEEPSEEK_V3, DEEPSEEK_V32)
