"""Model configuration: a dataclass built from a Hugging Face ``config.json``, reading only what it needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, LoadError, UnsupportedModelError
from .norms import LLAMA_NORM
from .config_fields import ACTIVATIONS, LAYER_TYPE_NAMES, mscale_all_dim, checked_rope_scaling
from .config_json import fields_from_hf
from .families import lookup
from .fields import read_json_object


@dataclass
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (``__post_init__`` derives ``head_dim`` where it is 0)."""

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
    # per-layer caches (see kvexplore.config.layer_plan): each layer's attention type, and the last layers that share
    # an earlier layer's cache; [] = every layer full attention (every layer sliding when sliding_window is set)
    layer_types: list[str] = field(default_factory=list)
    num_kv_shared_layers: int = 0
    rope_by_type: dict[str, dict[str, Any]] = field(default_factory=dict)  # layer type -> its own rope_theta/scaling
    layer_head_dims: dict[int, int] = field(default_factory=dict)  # layers whose head size is not head_dim
    layer_kv_head_counts: dict[int, int] = field(default_factory=dict)  # layers with their own kv head count
    # what the architecture adds to the Llama layer (its traits, see kvexplore.models.architectures)
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
    # values only one architecture's own blocks read, which need no field here (read by its family module)
    arch_options: dict[str, Any] = field(default_factory=dict)
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
            uniform = "full_attention" if self.sliding_window is None else "sliding_attention"
            self.layer_types = [uniform] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(where, "layer_types", f"{len(self.layer_types)} entries",
                              f"one per layer ({self.num_layers}, num_hidden_layers)")
        if bad := [t for t in self.layer_types if t not in LAYER_TYPE_NAMES]:
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
        for layer_type in set(self.layer_types[len(stored):]) - set(stored):
            raise ConfigError(where, "num_kv_shared_layers", self.num_kv_shared_layers,
                              f"a value that leaves a {layer_type} layer before the shared ones to read from")
        for layer_type, rope in self.rope_by_type.items():
            rope["rope_scaling"] = checked_rope_scaling(rope.get("rope_scaling"), f"{where} ({layer_type})")
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
        arch = lookup(self.architecture)
        if arch is not None and arch.check is not None:  # the architecture's own checks (latent sizes, ...)
            arch.check(self, where)
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(where, "num_experts_per_tok", self.experts_per_token,
                              f"1..{self.num_experts} (num_local_experts)")

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
        if not self.num_experts:
            return False
        if self.kv_lora_rank:
            return layer >= self.first_dense_layers
        return layer not in self.dense_layers

    def layer_kv_heads(self, layer: int) -> int:
        return self.layer_kv_head_counts.get(layer, self.num_kv_heads)

    def layer_head_dim(self, layer: int) -> int:
        return self.layer_head_dims.get(layer, self.head_dim)

    def layer_intermediate_size(self, layer: int) -> int:
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
            return self.qk_head_dim ** -0.5 * mscale_all_dim(self.rope_scaling) ** 2
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
        return {k: v for k, v in asdict(self).items() if k != "source"}

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that both :meth:`from_hf` and transformers read back to this config."""
        arch = lookup(self.architecture)
        if arch is None:
            raise UnsupportedModelError(f"{self.source}: architecture {self.architecture!r} is not registered, so "
                                        f"there is no config.json to write for it")
        raw = {
            "architectures": [self.architecture], "model_type": arch.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else (self.eos_token_id or None),
            "torch_dtype": self.torch_dtype or "float32",
        }
        if arch.to_hf is not None:
            raw.update(arch.to_hf(self))
        if self.sliding_window is not None:
            raw["sliding_window"] = self.sliding_window
        return raw

    @classmethod
    def from_hf(cls, raw: dict[str, Any], where: str = "config.json", mla: str = "absorbed") -> "ModelConfig":
        """Build from the parsed ``config.json`` of a transformers checkpoint (v4 or v5 layout). ``mla``: how a
        latent-attention model (DeepSeek) reads its cache, ``"absorbed"`` or ``"decompressed"``."""
        return cls(**fields_from_hf(raw, where, mla))

    @classmethod
    def from_file(cls, path: str | Path, mla: str = "absorbed") -> "ModelConfig":
        path = Path(path)
        raw = read_json_object(path, "a model folder needs a config.json (saved with the weights)")
        return cls.from_hf(raw, where=str(path), mla=mla)
