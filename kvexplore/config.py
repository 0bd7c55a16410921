"""Model configuration: a dataclass built from a Hugging Face ``config.json``, reading only what it needs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import LoadError, UnsupportedModelError

# architecture name in config.json -> whether q/k/v projections carry a bias by design
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


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

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.hidden_size % self.num_heads:
                raise LoadError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_heads}; give head_dim explicitly in config.json"
                )
            self.head_dim = self.hidden_size // self.num_heads
        if self.num_heads % self.num_kv_heads:
            raise LoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                f"{self.num_kv_heads}; grouped-query attention needs whole groups"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModelError(
                    f"rope scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
                )
            self.rope_scaling = None if kind == "default" else {**self.rope_scaling, "rope_type": kind}

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
        return asdict(self)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` that both :meth:`from_hf` and transformers read back to this config."""
        model_type = {v: k for k, v in _MODEL_TYPES.items()}[self.architecture]
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
    def from_hf(cls, raw: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        """Build from the parsed ``config.json`` of a transformers checkpoint (v4 or v5 layout)."""
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(raw.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{where}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in raw]
        if missing:
            raise LoadError(f"{where}: missing required keys {missing}")
        # transformers v5 moved rope_theta and rope_scaling into one "rope_parameters" dict
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        eos = raw.get("eos_token_id")
        bias = bool(raw.get("attention_bias", False))
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim") or 0),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=SUPPORTED_ARCHITECTURES[arch] or bias,
            o_bias=bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise LoadError(f"{path} not found: a model folder needs a config.json") from None
        except json.JSONDecodeError as e:
            raise LoadError(f"{path} is not valid JSON ({e})") from None
        return cls.from_hf(raw, where=str(path))


_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _arch_from_model_type(model_type: str | None) -> str:
    return _MODEL_TYPES.get(model_type or "", f"<model_type {model_type!r}>")
