"""How tensor parallelism splits a model over ``tp`` ranks (Megatron's split, as vLLM and SGLang make it): each rank
computes a contiguous share of the query heads, the KV heads those queries read, and a share of the MLP's width.
When ``tp`` exceeds the model's KV heads, each KV head is held by ``tp / kv_heads`` ranks (replicated, as vLLM does),
so a rank's cache is ``1 / kv_heads`` of the whole rather than ``1 / tp``."""

from __future__ import annotations

from dataclasses import dataclass

from ..config.model_config import ModelConfig
from ..errors import SettingsError


@dataclass(frozen=True)
class RankSplit:
    """What rank ``rank`` of ``tp`` computes and holds."""

    rank: int
    tp: int
    q_heads: range      # the query heads it computes
    kv_heads: range     # the KV heads its cache holds (the ones its queries read)
    width: range        # its share of the MLP's intermediate channels
    replicas: int       # how many ranks hold each of its KV heads (1: no replication)
    model_kv_heads: int = 0  # the whole model's KV heads

    def describe(self) -> str:
        shared = f" (held by {self.replicas} ranks)" if self.replicas > 1 else ""
        return f"rank {self.rank}: query heads {_span(self.q_heads, '')}, {_span(self.kv_heads, 'KV head')}{shared}"


def _span(r: range, what: str) -> str:
    word = f"{what}s " if what and len(r) > 1 else (f"{what} " if what else "")
    return f"{word}{r.start}" if len(r) == 1 else f"{word}{r.start}-{r.stop - 1}"


def check_splittable(config: ModelConfig, tp: int) -> None:
    """Refuse a ``tp`` the model cannot be split by, or a model this split does not cover, naming why and what works."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise SettingsError(f"tp must be a whole number of ranks, 1 or more, got {tp!r}")
    where = config.source
    unsupported = [(config.num_experts, "experts"), (config.kv_lora_rank, "a latent (MLA) cache"),
                   (config.linear_key_heads, "linear-attention layers"), (config.gated_attention, "gated attention"),
                   (config.num_kv_shared_layers, "layers sharing another layer's cache"),
                   (config.layer_kv_head_counts or config.layer_head_dims, "layers with their own head sizes"),
                   (config.attention_sinks, "learned attention sinks")]
    for present, what in unsupported:
        if present:
            raise SettingsError(f"{where}: tensor parallelism here splits Llama-family decoders (Llama, Mistral, "
                                f"Qwen2/3, Gemma 3); this model has {what}, which it does not split")
    nh, nkv = config.num_heads, config.num_kv_heads
    if nh % tp:
        raise SettingsError(f"tp {tp} does not divide the model's {nh} query heads: each rank must compute whole "
                            f"heads (try {', '.join(str(d) for d in _divisors(nh) if d > 1)})")
    if nkv % tp and tp % nkv:
        raise SettingsError(f"tp {tp} neither divides the model's {nkv} KV heads nor is a multiple of them: each rank "
                            f"must hold whole KV heads, or each KV head whole copies")
    if config.intermediate_size % tp:
        raise SettingsError(f"tp {tp} does not divide the MLP's width {config.intermediate_size}")


def split(config: ModelConfig, tp: int, rank: int) -> RankSplit:
    check_splittable(config, tp)
    if not 0 <= rank < tp:
        raise SettingsError(f"rank {rank} does not exist among tp {tp} ranks (0..{tp - 1})")
    nh, nkv, width = config.num_heads, config.num_kv_heads, config.intermediate_size
    q = nh // tp
    if tp <= nkv:
        kv, replicas = range(rank * nkv // tp, (rank + 1) * nkv // tp), 1
    else:
        head = rank // (tp // nkv)
        kv, replicas = range(head, head + 1), tp // nkv
    w = width // tp
    return RankSplit(rank, tp, range(rank * q, (rank + 1) * q), kv, range(rank * w, (rank + 1) * w), replicas, nkv)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
