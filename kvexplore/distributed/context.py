"""Context parallelism for decoding (the layout of vLLM's and SGLang's decode context parallelism): the cache's
positions spread over ``cp`` ranks in runs of ``interleave`` (position ``p`` on rank ``(p // interleave) % cp``), each
rank holding the whole model and ``1 / cp`` of the cache. Every rank computes every token's queries, keys and values;
only the owner of a position stores its key and value. Each rank attends over the keys it holds, giving its share of
the output and the log-sum-exp of its scores; an all-gather brings every rank's pair, and each rank merges them::

    out = sum_r exp(lse_r - M) * out_r / sum_r exp(lse_r - M),   M = max_r lse_r

which is attention over all the keys (a rank holding none of a query's keys gives ``lse = -inf``, weight 0). Sliding
layers apply their window by global positions on every rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..caches.layer import Step
from ..caches.layers.preallocated_layer import PreallocatedLayer
from ..caches.masks import positions_mask
from ..caches.slots import FILLED, FREE, STALE, SlotView
from ..caches.strategies.preallocated import PreallocatedCache
from ..core.hooks import hook
from ..errors import SettingsError
from ..models.model import Attention
from .reduce import Traffic


class Layout:
    """Which rank holds which position: ``(p // interleave) % cp``."""

    def __init__(self, cp: int, interleave: int, rank: int) -> None:
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
            raise SettingsError(f"cp must be a whole number of ranks, 1 or more, got {cp!r}")
        if isinstance(interleave, bool) or not isinstance(interleave, int) or interleave < 1:
            raise SettingsError(f"interleave must be a whole number of positions, 1 or more, got {interleave!r}")
        self.cp, self.interleave, self.rank = cp, interleave, rank

    def owner(self, p: int) -> int:
        return (p // self.interleave) % self.cp

    def held_before(self, n: int) -> int:
        """How many of positions ``0..n-1`` this rank holds (its local slots for them)."""
        cycle = self.cp * self.interleave
        whole, rest = divmod(n, cycle)
        return whole * self.interleave + min(max(rest - self.rank * self.interleave, 0), self.interleave)

    def positions(self, start: int, end: int) -> list[int]:
        """The positions of ``start..end-1`` this rank holds, in order."""
        return [p for p in range(start, end) if self.owner(p) == self.rank]

    def describe(self) -> str:
        nth = f"{self.cp}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(self.cp, 'th')}"
        first = self.rank * self.interleave
        if self.interleave == 1:
            return f"rank {self.rank}: every {nth} position from {first} ({first}, {first + self.cp}, ...)"
        cycle = self.cp * self.interleave
        return (f"rank {self.rank}: every {nth} run of {self.interleave} positions from {first} ({first}-"
                f"{first + self.interleave - 1}, {first + cycle}-{first + cycle + self.interleave - 1}, ...)")


class ContextParallelLayer(PreallocatedLayer):
    """A pre-allocated layer of the positions its rank holds: local slot ``i`` holds the rank's ``i``-th position.
    A write stores the step's positions this rank holds; attention reads every local slot so far, masked by global
    positions (causal, and the window of a sliding layer)."""

    def __init__(self, spec, batch_size, dtype, device, capacity: int, layout: Layout) -> None:
        self.layout = layout
        super().__init__(spec, batch_size, dtype, device, layout.held_before(capacity))
        self.global_capacity = capacity

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos, q_len = step.pos, k.shape[2]
        mine = [p - pos for p in self.layout.positions(pos, pos + q_len)]
        start = self.layout.held_before(pos)
        if mine:
            self.prepare(step, start, len(mine))
            index = torch.tensor(mine, device=k.device)
            self.k.narrow(2, start, len(mine)).copy_(k.index_select(2, index))
            self.v.narrow(2, start, len(mine)).copy_(v.index_select(2, index))
        n = start + len(mine)
        return self.k.narrow(2, 0, n), self.v.narrow(2, 0, n)

    def mask(self, step: Step) -> torch.Tensor:
        """Always a ``(q_len, local keys)`` mask: the local keys are not the positions ``0..n-1``."""
        keys = torch.tensor(self.layout.positions(0, step.end), device=step.device, dtype=torch.long)
        queries = torch.arange(step.pos, step.end, device=step.device)
        return positions_mask(queries, keys, self.window)

    def _read_positions(self, length: int) -> list[int]:
        """The positions of the local keys read (this rank's, in slot order; the mask keeps each query's own)."""
        return self.layout.positions(0, length)

    def commit(self, step: Step) -> None:
        local = self.layout.held_before(step.end)
        if local > self.high_water:
            step.journal.remember(self._set_high_water, self.high_water)
            self.high_water = local

    def _slot_view(self, length: int) -> SlotView:
        held = self.layout.positions(0, length)
        n, hw, cap = len(held), self.high_water, self.capacity
        states = [FILLED] * n + [STALE] * (hw - n) + [FREE] * (cap - hw)
        return SlotView(states, held + [-1] * (cap - n), [1] * n + [0] * (cap - n))


class ContextParallelCache(PreallocatedCache):
    """A rank's cache under context parallelism: every layer a :class:`ContextParallelLayer` (sliding layers too,
    each query reading its window by global positions)."""

    kind = "context-parallel"
    keeps_windows_whole = True

    def __init__(self, config, max_seq_len: int, layout: Layout, batch_size: int = 1, dtype=None,
                 device=None) -> None:
        self.layout = layout
        super().__init__(config, max_seq_len, batch_size, dtype, device)

    def full_layer(self, spec) -> ContextParallelLayer:
        return ContextParallelLayer(spec, self.batch_size, self.dtype, self.device, self._capacity, self.layout)


class ContextParallelAttention(Attention):
    """The model's attention with its output merged over the ranks by log-sum-exp (the same weights)."""

    traffic: Traffic
    group = None

    def attend(self, q, k_all, v_all, mask, tracer, name):
        B, nh, T, hd = q.shape
        g = nh // self.nkv
        qg = q.reshape(B, self.nkv, g * T, hd).float()
        scores = (qg @ k_all.float().transpose(-1, -2)) * self.scale  # (B, nkv, g*T, S_local)
        rows = mask.repeat(g, 1)  # (g*T, S_local), as the scores' rows (head in group, token)
        scores = scores.masked_fill(~rows, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # -inf where this rank holds none of a row's keys
        weights = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min))  # a row without keys: all 0
        out = weights @ v_all.float()  # (B, nkv, g*T, hd)
        t0 = time.perf_counter()
        outs = [torch.empty_like(out) for _ in range(dist.get_world_size(self.group))]
        lses = [torch.empty_like(lse) for _ in outs]
        dist.all_gather(outs, out, group=self.group)
        dist.all_gather(lses, lse, group=self.group)
        self.traffic.add(out, time.perf_counter() - t0)  # the two all-gathers: the shares, then their lse
        self.traffic.add(lse, 0.0)
        lse_all = torch.stack(lses)  # (cp, B, nkv, g*T, 1)
        top = lse_all.amax(0)
        share = torch.exp(lse_all - top)  # every row has keys on some rank: top is finite
        merged = (share * torch.stack(outs)).sum(0) / share.sum(0)
        if tracer is not None and tracer.wants_attention(self.layer):  # what the merged rows give this rank's keys
            whole = top + torch.log(share.sum(0))  # each merged row's log-sum-exp
            hook(tracer, f"{name}.probs", (weights * torch.exp(lse - whole)).view(B, nh, T, -1))
        return merged.view(B, nh, T, hd).to(q.dtype)


def check_mergeable(c) -> None:
    """Refuse a model whose attention this merge does not cover."""
    if c.attention_sinks or c.attn_logit_softcapping or c.kv_lora_rank or c.linear_key_heads or \
            c.num_kv_shared_layers or c.gated_attention:
        raise SettingsError(f"{c.source}: context parallelism here splits the caches of Llama-family decoders "
                            f"(Llama, Mistral, Qwen2/3, Gemma 3); this model's attention is not one it merges")


def context_parallel(model, layout: Layout, group=None):
    """``model`` made a context-parallel rank (in place: its attention modules merge over the ranks); the model
    keeps all its weights. Its ``traffic`` counts the all-gathers."""
    check_mergeable(model.config)
    model.traffic = Traffic()
    for layer in model.model.layers:
        layer.self_attn.__class__ = ContextParallelAttention
        layer.self_attn.traffic, layer.self_attn.group = model.traffic, group
    model.layout = layout
    return model
