"""One rank's model under tensor parallelism: the full model's weights sliced by :func:`~.split.split` (q/k/v and
gate/up by their output rows, o and down by their input columns) into a model of the same architecture whose config
has the rank's heads and width, with ``o_proj`` and ``down_proj`` summed over the ranks by an all-reduce. Its caches
are ordinary caches of that smaller model: every strategy works on a rank, and each rank's memory report counts the
bytes it holds."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..models.model import Model
from .reduce import RowParallelLinear, Traffic
from .split import RankSplit

COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "width", "up_proj": "width"}  # output rows
ROW = {"o_proj": "q", "down_proj": "width"}  # input columns, summed over ranks


def _channels(part: RankSplit, which: str, head_dim: int) -> slice:
    r = {"q": part.q_heads, "kv": part.kv_heads, "width": part.width}[which]
    unit = 1 if which == "width" else head_dim
    return slice(r.start * unit, r.stop * unit)


def shard_weight(name: str, tensor: torch.Tensor, part: RankSplit, head_dim: int) -> torch.Tensor:
    """The rank's slice of one parameter of the full model (a copy: the rank holds only its share)."""
    *_, module, suffix = name.split(".")
    if module in COLUMN:
        return tensor[_channels(part, COLUMN[module], head_dim)].clone()
    if module in ROW:
        if suffix == "bias":  # added once, by rank 0
            return tensor.clone() if part.rank == 0 else torch.zeros_like(tensor)
        return tensor[:, _channels(part, ROW[module], head_dim)].clone()
    return tensor  # embeddings, norms, the output head: every rank has them whole


def shard_model(model: Model, part: RankSplit, group=None) -> Model:
    """Rank ``part.rank``'s model: the same architecture with its heads and width, the full model's weights sliced;
    its ``traffic`` counts the all-reduces of its row-split products."""
    c = model.config
    config = replace(c, num_heads=len(part.q_heads), num_kv_heads=len(part.kv_heads),
                     intermediate_size=len(part.width), head_dim=c.head_dim)
    rank = Model.skeleton(config)
    state = {name: shard_weight(name, t, part, c.head_dim) for name, t in model.state_dict().items()}
    rank.load_state_dict(state, assign=True, strict=True)
    rank.rotary = model.rotary  # the same angles (head_dim is the same); not a weight, so not on the meta device
    rank.traffic = Traffic()
    for layer in rank.model.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, rank.traffic, group)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, rank.traffic, group)
    rank.tokenizer, rank.source = model.tokenizer, f"{model.source or c.architecture} (rank {part.rank} of {part.tp})"
    rank.split = part
    return rank.eval()
