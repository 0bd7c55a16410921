"""What each supported architecture adds to the Llama decoder, stated once as data.

The decoder in :mod:`kvexplore.models.model` is one Llama-style layer with switches; an architecture is the set of
switches it turns on (:class:`Traits`) plus how its ``config.json`` names them. Everything here was checked
against transformers 5.24 on random-weight models (tests/test_parity_2025.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# RMSNorm styles: how the weight is applied after normalising in float32
LLAMA_NORM = "llama"  # cast back to the dtype, then * weight
GEMMA_NORM = "gemma"  # * (1 + weight) in float32, then cast (the checkpoint stores weight - 1)
FLOAT32_NORM = "float32"  # * weight in float32, then cast


@dataclass(frozen=True)
class Traits:
    model_type: str
    qkv_bias: bool = False  # q/k/v projections carry a bias by design (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3/4)
    v_norm: bool = False  # a weightless RMSNorm over each head of v (Gemma 4)
    norm: str = LLAMA_NORM
    sandwich_norms: bool = False  # norms before and after attention and the MLP (Gemma)
    embed_scale: bool = False  # embeddings * sqrt(hidden_size) (Gemma)
    hidden_act: str = "silu"
    attention_sinks: bool = False  # a learned logit per head in every softmax denominator (gpt-oss)
    layer_scalar: bool = False  # each layer's output (residual included) times a stored scalar (Gemma 4)
    unit_attention_scale: bool = False  # scores are q . k, not q . k / sqrt(d) (Gemma 4: q/k norms instead)
    query_pre_attn_scalar: bool = False  # scale = query_pre_attn_scalar ** -0.5 (Gemma 3)
    mixture_of_experts: bool = False  # gpt-oss's router and experts instead of one MLP
    latent_attention: bool = False  # DeepSeek's MLA: one latent and one rope key cached per position
    gated_attention: bool = False  # Qwen3-Next: q_proj also gives a per-head output gate, sigmoid(gate) * out
    default_theta: float = 10000.0
    local_theta: float | None = None  # RoPE base of the sliding layers when the config gives none (Gemma 3)
    pattern: int | None = None  # without layer_types: every pattern-th layer is full, the others slide
    last_layer_full: bool = False  # the last layer is always full attention (Gemma 4)


ARCHITECTURES: dict[str, Traits] = {
    "LlamaForCausalLM": Traits("llama"),
    "MistralForCausalLM": Traits("mistral"),
    "Qwen2ForCausalLM": Traits("qwen2", qkv_bias=True),
    "Qwen3ForCausalLM": Traits("qwen3", qk_norm=True),
    "Gemma3ForCausalLM": Traits("gemma3_text", qk_norm=True, norm=GEMMA_NORM, sandwich_norms=True, embed_scale=True,
                                hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=True, default_theta=1e6,
                                local_theta=1e4, pattern=6),
    "GptOssForCausalLM": Traits("gpt_oss", norm=FLOAT32_NORM, attention_sinks=True, mixture_of_experts=True,
                                default_theta=150000.0, pattern=2),
    "Qwen3NextForCausalLM": Traits("qwen3_next", qk_norm=True, norm=GEMMA_NORM, gated_attention=True,
                                   pattern=4),
    "DeepseekV3ForCausalLM": Traits("deepseek_v3", norm=FLOAT32_NORM, latent_attention=True),
    "DeepseekV32ForCausalLM": Traits("deepseek_v32", norm=FLOAT32_NORM, latent_attention=True),
    "Gemma4ForCausalLM": Traits("gemma4_text", qk_norm=True, v_norm=True, norm=FLOAT32_NORM, sandwich_norms=True,
                                embed_scale=True, hidden_act="gelu_pytorch_tanh", layer_scalar=True,
                                unit_attention_scale=True, default_theta=1e6, local_theta=1e4, pattern=6,
                                last_layer_full=True),
}
MODEL_TYPES = {t.model_type: name for name, t in ARCHITECTURES.items()}

# Gemma 4 options that do not touch the cache and that kvexplore does not implement: config key -> what it is
GEMMA4_REFUSED = {
    "hidden_size_per_layer_input": "per-layer input embeddings (PLE)",
    "enable_moe_block": "the mixture-of-experts block",
    "attention_k_eq_v": "keys used as values in full layers (attention_k_eq_v)",
    "use_bidirectional_attention": "bidirectional attention",
}


def default_layer_types(traits: Traits, num_layers: int) -> list[str]:
    """The layer types an architecture uses when ``config.json`` lists none (and has a sliding window)."""
    every = traits.pattern or 1
    types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(num_layers)]
    if traits.last_layer_full:
        types[-1] = "full_attention"
    return types
