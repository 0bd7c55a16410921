"""Model configuration: a dataclass built from a Hugging Face ``config.json``, reading only what it needs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, LoadError, UnsupportedModelError
from .architectures import ARCHITECTURES, GEMMA4_REFUSED, LLAMA_NORM, MODEL_TYPES, default_layer_types
from .fields import BOOL, DICT, FLOAT, IDS, INT, STR, STR_LIST, Field, check, read, read_json_object

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
LAYER_TYPE_NAMES = ("full_attention", "sliding_attention", "linear_attention", "indexed_attention")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")

# plausibility bounds: past these a config is damaged (the largest released models are far inside them), and
# sizes this large would make the loader build millions of names or allocate terabytes before failing
MAX_LAYERS, MAX_HEADS, MAX_HEAD_DIM = 1024, 1024, 2048
MAX_HIDDEN, MAX_FFN, MAX_VOCAB, MAX_POSITIONS = 1 << 16, 1 << 20, 1 << 22, 1 << 30

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
# rope_scaling / rope_parameters entries, by scaling type
_ROPE_FIELDS = {
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


def checked_rope_scaling(rope: dict[str, Any] | None, where: str) -> dict[str, Any] | None:
    """``rope`` (without ``rope_theta``) checked for its type: ``None`` for plain RoPE, else a dict with
    ``rope_type`` and the numbers that type needs, each checked."""
    if not rope:
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    if not isinstance(kind, str):
        raise ConfigError(where, "rope_scaling.rope_type", kind, f"one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where}: rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if kind == "default":
        return None
    values = read(rope, _ROPE_FIELDS[kind], f"{where} (rope_scaling)")
    if kind == "llama3" and values["high_freq_factor"] <= values["low_freq_factor"]:
        raise ConfigError(where, "rope_scaling.high_freq_factor", values["high_freq_factor"],
                          f"more than low_freq_factor ({values['low_freq_factor']})")
    return {**rope, **{k: v for k, v in values.items() if v is not None}, "rope_type": kind}


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder.

    Derived fields (``head_dim`` when the config omits it, ``kv_groups``) are filled in ``__post_init__``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear"|"llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: each query sees at most this many keys
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None  # dtype the checkpoint was saved in, if it says
    # per-layer caches (see kvexplore.layer_plan): each layer's attention type, and the last layers that share
    # an earlier layer's cache; [] = every layer full attention (every layer sliding when sliding_window is set)
    layer_types: list[str] = field(default_factory=list)
    num_kv_shared_layers: int = 0
    rope_by_type: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer type -> its own rope_theta/scaling
    layer_head_dims: dict[int, int] = field(default_factory=dict)  # layers whose head size is not head_dim
    layer_kv_head_counts: dict[int, int] = field(default_factory=dict)  # layers with their own kv head count
    # what the architecture adds to the Llama layer (see kvexplore.architectures)
    qk_norm: bool = False  # Qwen3, Gemma: RMSNorm over each head of q and k before RoPE
    v_norm: bool = False  # Gemma 4: a weightless RMSNorm over each head of v
    norm_style: str = LLAMA_NORM
    sandwich_norms: bool = False  # Gemma: norms before and after attention and the MLP
    embed_scale: bool = False  # Gemma: embeddings * sqrt(hidden_size)
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None  # attention scale is query_pre_attn_scalar ** -0.5 when given
    unit_attention_scale: bool = False  # Gemma 4: scores are q . k (its q/k norms keep them in range)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax
    layer_scalar: bool = False  # Gemma 4: each layer's output times a stored scalar
    num_experts: int = 0  # gpt-oss: experts per layer (0: a dense MLP)
    experts_per_token: int = 0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    double_wide_mlp: bool = False  # Gemma 4: shared layers' MLP is twice as wide
    # DeepSeek: multi-head latent attention (kv_lora_rank > 0) and routed + shared experts after the dense layers
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries by one projection
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    mla: str = "absorbed"  # how attention reads the latents: "absorbed" (directly) or "decompressed" (per-head K/V)
    shared_experts: int = 0
    expert_groups: int = 1
    groups_per_token: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_dense_layers: int = 0
    moe_intermediate_size: int = 0
    # DeepSeek-V3.2: a lightning indexer picks the index_topk positions each query reads (0: every position)
    index_topk: int = 0
    index_heads: int = 0
    index_head_dim: int = 0
    # Qwen3-Next: gated DeltaNet layers (a fixed-size state per layer) and gated, partly rotated attention
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    conv_kernel: int = 0
    gated_attention: bool = False
    rotary_fraction: float = 1.0  # the share of each head's channels RoPE turns (the first ones)
    shared_expert_size: int = 0  # one shared expert of this width, scaled by a sigmoid gate (Qwen3-Next)
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP among experts
    source: str = field(default="model config", compare=False, repr=False)  # the file errors name

    def __post_init__(self) -> None:
        where = self.source
        if self.num_heads < 1 or self.num_kv_heads < 1:
            raise ConfigError(where, "num_attention_heads / num_key_value_heads",
                              (self.num_heads, self.num_kv_heads), "at least 1 head each")
        if not self.head_dim:
            if self.hidden_size % self.num_heads:
                raise LoadError(
                    f"{where}: hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_heads}; give head_dim explicitly in config.json"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise LoadError(
                f"{where}: num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        if self.head_dim % 2:
            raise ConfigError(where, "head_dim", self.head_dim, "an even number (RoPE rotates pairs of channels)")
        self.rope_scaling = checked_rope_scaling(self.rope_scaling, where)
        self._check_layers(where)
        for name, ids in (("bos_token_id", [] if self.bos_token_id is None else [self.bos_token_id]),
                          ("eos_token_id", self.eos_token_id)):
            if any(not 0 <= i < self.vocab_size for i in ids):
                raise ConfigError(where, name, ids[0] if name == "bos_token_id" else ids,
                                  f"token ids in 0..{self.vocab_size - 1} (vocab_size is {self.vocab_size})")

    def _check_layers(self, where: str) -> None:
        if not self.layer_types:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            self.layer_types = [kind] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(where, "layer_types", f"{len(self.layer_types)} entries",
                              f"one per layer ({self.num_layers}, num_hidden_layers)")
        bad = [t for t in self.layer_types if t not in LAYER_TYPE_NAMES]
        if bad:
            raise UnsupportedModelError(f"{where}: layer type {bad[0]!r} is not supported; supported: "
                                        f"{', '.join(LAYER_TYPE_NAMES)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError(where, "sliding_window", None, "a window size (the config has sliding_attention layers)")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(f"{where}: activation {self.hidden_act!r} is not supported; supported: "
                                        f"{', '.join(ACTIVATIONS)}")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ConfigError(where, "num_kv_shared_layers", self.num_kv_shared_layers,
                              f"0..{self.num_layers - 1} (fewer than num_hidden_layers)")
        stored = self.layer_types[: self.num_layers - self.num_kv_shared_layers]
        for kind in set(self.layer_types[len(stored):]) - set(stored):
            raise ConfigError(where, "num_kv_shared_layers", self.num_kv_shared_layers,
                              f"a value that leaves a {kind} layer before the shared ones to read from")
        for kind, rope in self.rope_by_type.items():
            rope["rope_scaling"] = checked_rope_scaling(rope.get("rope_scaling"), f"{where} ({kind})")
        for i in (*self.layer_head_dims, *self.layer_kv_head_counts):
            if not 0 <= i < self.num_layers:
                raise ConfigError(where, "per_layer_config", i, f"layer numbers 0..{self.num_layers - 1}")
        for i in range(self.num_layers):
            heads, dim = self.layer_kv_heads(i), self.layer_head_dim(i)
            if self.num_heads % heads:
                raise LoadError(f"{where}: layer {i} has {heads} key/value heads, which does not divide "
                                f"num_attention_heads {self.num_heads}; grouped-query attention needs whole groups")
            if dim % 2:
                raise ConfigError(where, f"head_dim of layer {i}", dim, "an even number (RoPE rotates pairs)")
        if self.kv_lora_rank:
            self._check_latent(where)
        if "linear_attention" in self.layer_types:
            for name in ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "conv_kernel"):
                if getattr(self, name) < 1:
                    raise ConfigError(where, name, getattr(self, name), "a positive size (linear attention needs it)")
            if self.linear_value_heads % self.linear_key_heads:
                raise ConfigError(where, "linear_num_value_heads", self.linear_value_heads,
                                  f"a multiple of linear_num_key_heads ({self.linear_key_heads})")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(where, "num_experts_per_tok", self.experts_per_token,
                              f"1..{self.num_experts} (num_local_experts)")

    def _check_latent(self, where: str) -> None:
        if self.mla not in ("absorbed", "decompressed"):
            raise ConfigError(where, "mla", self.mla, '"absorbed" or "decompressed"')
        for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(where, name, getattr(self, name), "a positive size (latent attention needs it)")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(where, "qk_rope_head_dim", self.qk_rope_head_dim, "an even number (RoPE turns pairs)")
        if self.index_topk and (self.index_heads < 1 or self.index_head_dim < self.qk_rope_head_dim
                                or not self.q_lora_rank):
            raise ConfigError(where, "index_n_heads / index_head_dim", (self.index_heads, self.index_head_dim),
                              f"at least 1 head of at least qk_rope_head_dim ({self.qk_rope_head_dim}) channels, "
                              f"and a q_lora_rank (the indexer reads the compressed query)")
        if self.num_experts and (self.num_experts % self.expert_groups
                                 or not 1 <= self.groups_per_token <= self.expert_groups):
            raise ConfigError(where, "n_group / topk_group", (self.expert_groups, self.groups_per_token),
                              f"groups that divide n_routed_experts ({self.num_experts}), 1 <= topk_group <= n_group")

    @property
    def qk_head_dim(self) -> int:
        """Width of a latent-attention query and key head: the part without position plus the rope part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of a linear-attention layer's causal convolution: its queries, keys and values."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    def state_bytes(self, batch_size: int = 1, itemsize: int = 4) -> int:
        """Bytes of one linear-attention layer's state: the last ``conv_kernel - 1`` inputs of its convolution (in
        the dtype) and the recurrent ``(value heads, key dim, value dim)`` matrix (float32)."""
        conv = self.conv_channels * (self.conv_kernel - 1) * itemsize
        return batch_size * (conv + self.linear_value_heads * self.linear_key_dim * self.linear_value_dim * 4)

    def uses_experts(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward block is a mixture of experts."""
        if not self.num_experts:
            return False
        if self.kv_lora_rank:
            return layer >= self.first_dense_layers
        return layer not in self.dense_layers

    def layer_kv_heads(self, layer: int) -> int:
        """Key/value heads of ``layer``."""
        return self.layer_kv_head_counts.get(layer, self.num_kv_heads)

    def layer_head_dim(self, layer: int) -> int:
        """Head size of ``layer``'s queries, keys and values."""
        return self.layer_head_dims.get(layer, self.head_dim)

    def layer_intermediate_size(self, layer: int) -> int:
        """Width of ``layer``'s MLP."""
        shared = layer >= self.num_layers - self.num_kv_shared_layers
        return self.intermediate_size * (2 if self.double_wide_mlp and shared else 1)

    def rope_for(self, layer_type: str) -> tuple[float, dict[str, Any] | None]:
        """``(rope_theta, rope_scaling)`` of the layers of ``layer_type``."""
        own = self.rope_by_type.get(layer_type, {})
        return own.get("rope_theta", self.rope_theta), own.get("rope_scaling", self.rope_scaling)

    def attention_scale(self, layer: int) -> float:
        """What ``layer``'s query-key dot products are multiplied by before the softmax."""
        if self.unit_attention_scale:
            return 1.0
        if self.kv_lora_rank:  # over the whole query head, times YaRN's mscale squared (DeepSeek)
            return self.qk_head_dim ** -0.5 * _mscale_all_dim(self.rope_scaling) ** 2
        return (self.query_pre_attn_scalar or self.layer_head_dim(layer)) ** -0.5

    @property
    def kv_groups(self) -> int:
        """How many query heads share one key/value head (1 = multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def gqa_groups(self) -> list[list[int]]:
        """For each key/value head, the query heads that read it."""
        g = self.kv_groups
        return [list(range(kv * g, (kv + 1) * g)) for kv in range(self.num_kv_heads)]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("source")
        return d

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that both :meth:`from_hf` and transformers read back to this config."""
        model_type = ARCHITECTURES[self.architecture].model_type
        raw = {
            "architectures": [self.architecture], "model_type": model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None),
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.architecture == "LlamaForCausalLM":
            raw.update(attention_bias=self.o_bias, mlp_bias=self.mlp_bias)
        if self.architecture == "Qwen2ForCausalLM":
            raw["use_sliding_window"] = False
        if self.sliding_window is not None:
            raw["sliding_window"] = self.sliding_window
        return raw

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str = "config.json", mla: str = "absorbed") -> "ModelConfig":
        """Build from the parsed ``config.json`` of a transformers checkpoint (v4 or v5 layout). ``mla``: how a
        latent-attention model (DeepSeek) reads its cache, ``"absorbed"`` or ``"decompressed"``."""
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
        return cls(
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

    @classmethod
    def from_file(cls, path: str | Path, mla: str = "absorbed") -> "ModelConfig":
        path = Path(path)
        raw = read_json_object(path, "a model folder needs a config.json (saved with the weights)")
        return cls.from_hf(raw, where=str(path), mla=mla)


_ROPE_THETA = Field("rope_parameters.rope_theta", FLOAT, 0, 1e12, lo_open=True, required=True)


def _mscale_all_dim(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's correction of the softmax scale under YaRN: ``0.1 * mscale_all_dim * ln(factor) + 1``."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0


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
