"""The Llama family: Llama 1/2/3, Mistral, Qwen2 and Qwen3, the plain decoder every other family extends.

They differ only in switches: Qwen2's q/k/v projections carry a bias, Qwen3 normalises each query and key head
(``q_norm``/``k_norm``) before RoPE, Mistral may slide a window over every layer (``sliding_window``, read by the
common reader). llama.cpp writes Llama and Qwen2 to GGUF with the same tensor names; only Llama's q/k rows are in
its rope order.
"""

from __future__ import annotations

from typing import Any

from ...config.families import Architecture, GGUFNames

#: llama.cpp's tensor names: blk.N.<key> -> model.layers.N.<value>, and the ones outside the layers
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                     "output.weight": "lm_head.weight"}


def _llama_to_hf(config: Any) -> dict[str, Any]:
    return {"attention_bias": config.o_bias, "mlp_bias": config.mlp_bias}


LLAMA = Architecture(
    "llama", "LlamaForCausalLM", "llama", "llama", to_hf=_llama_to_hf,
    transformers=("LlamaConfig", "LlamaForCausalLM"),
    gguf=GGUFNames("llama", True, GGUF_LAYER_NAMES, GGUF_GLOBAL_NAMES))
MISTRAL = Architecture("mistral", "MistralForCausalLM", "mistral", "llama",
                       transformers=("MistralConfig", "MistralForCausalLM"))
QWEN2 = Architecture(
    "qwen2", "Qwen2ForCausalLM", "qwen2", "llama", traits={"qkv_bias": True},
    to_hf=lambda config: {"use_sliding_window": False}, transformers=("Qwen2Config", "Qwen2ForCausalLM"),
    gguf=GGUFNames("qwen2", False, GGUF_LAYER_NAMES, GGUF_GLOBAL_NAMES))
QWEN3 = Architecture("qwen3", "Qwen3ForCausalLM", "qwen3", "llama", traits={"qk_norm": True},
                     transformers=("Qwen3Config", "Qwen3ForCausalLM"), example={"head_dim": 16})

ARCHITECTURES = (LLAMA, MISTRAL, QWEN2, QWEN3)
