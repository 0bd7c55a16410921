"""Model configuration: a dataclass built from a Hugging Face ``config.json``, reading only what it needs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, LoadError, UnsupportedModelError
from .fields import BOOL, DICT, FLOAT, IDS, INT, STR, STR_LIST, Field, check, read, read_json_object

# architecture name in config.json -> whether q/k/v projections carry a bias by design
SUPPORTED_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

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
)
# rope_scaling / rope_parameters entries, by scaling type
_ROPE_FIELDS = {
    "linear": (Field("factor", FLOAT, 0, 1e6, required=True, lo_open=True),),
    "llama3": (Field("factor", FLOAT, 0, 1e6, required=True, lo_open=True),
               Field("low_freq_factor", FLOAT, 0, 1e6, required=True, lo_open=True),
               Field("high_freq_factor", FLOAT, 0, 1e6, required=True, lo_open=True),
               Field("original_max_position_embeddings", INT, 1, MAX_POSITIONS)),
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
        for name, ids in (("bos_token_id", [] if self.bos_token_id is None else [self.bos_token_id]),
                          ("eos_token_id", self.eos_token_id)):
            if any(not 0 <= i < self.vocab_size for i in ids):
                raise ConfigError(where, name, ids[0] if name == "bos_token_id" else ids,
                                  f"token ids in 0..{self.vocab_size - 1} (vocab_size is {self.vocab_size})")

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
        if not isinstance(raw, dict):
            raise ConfigError(where, "the top level", type(raw).__name__, "a JSON object ({...})")
        v = read(raw, CONFIG_FIELDS, where)
        archs = v["architectures"] or []
        arch = archs[0] if archs else _arch_from_model_type(v["model_type"])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{where}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers v5 moved rope_theta and rope_scaling into one "rope_parameters" dict
        rope = dict(v["rope_parameters"] or v["rope_scaling"] or {})
        theta = v["rope_theta"]
        if "rope_theta" in rope:
            theta = check(rope.pop("rope_theta"), Field("rope_parameters.rope_theta", FLOAT, 0, 1e12, lo_open=True,
                                                        required=True), where)
        eos = v["eos_token_id"]
        bias = bool(v["attention_bias"])
        window = v["sliding_window"] if v["use_sliding_window"] is not False else None
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
            rope_theta=10000.0 if theta is None else theta,
            rope_scaling=rope or None,
            max_position_embeddings=v["max_position_embeddings"] or 2048,
            tie_word_embeddings=bool(v["tie_word_embeddings"]),
            qkv_bias=SUPPORTED_ARCHITECTURES[arch] or bias,
            o_bias=bias,
            mlp_bias=bool(v["mlp_bias"]),
            sliding_window=window,
            bos_token_id=v["bos_token_id"],
            eos_token_id=eos or [],
            torch_dtype=v["torch_dtype"] or v["dtype"],
            source=where,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        raw = read_json_object(path, "a model folder needs a config.json (saved with the weights)")
        return cls.from_hf(raw, where=str(path))


_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _arch_from_model_type(model_type: str | None) -> str:
    return _MODEL_TYPES.get(model_type or "", f"<model_type {model_type!r}>")
