"""What a press sees of one layer when it scores: the held keys and values, the recent queries, the accumulated
attention, and the attention those queries give the held keys.

Shapes: ``B`` batch, ``H`` KV heads, ``S`` slots of the layer's storage the press scores (a slot may be empty or hidden:
``valid``), ``nh`` query heads (``g = nh // H`` per KV head), ``W`` recent queries, ``w`` head width."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import SettingsError

NEG = float("-inf")


@dataclass
class Observation:
    """One layer at the moment a press runs (see the module docstring for the shapes)."""

    layer: int
    keys: torch.Tensor  # (B, H, S, w), after RoPE, as stored
    values: torch.Tensor  # (B, H, S, w)
    valid: torch.Tensor  # (B, H, S) bool: the slot holds a key the press may keep
    positions: torch.Tensor  # (B, H, S) long: the sequence position each slot holds (-1: none)
    queries: torch.Tensor | None  # (B, nh, W, w) the last W queries, after RoPE (None: the press asked for none)
    query_positions: torch.Tensor | None  # (W,) long
    accumulated: torch.Tensor | None  # (B, H, S) float32: attention every query so far gave each slot (H2O)
    scale: float
    softcap: float | None
    length: int  # positions of the sequence so far
    n_kept: int  # how many positions per head the budget keeps in this layer (the mean, with per-head budgets)
    sinks: torch.Tensor | None = None  # (nh,) the layer's learned sink logits (gpt-oss), in every softmax

    def attention(self, last: int | None = None) -> torch.Tensor:
        """The attention ``(B, nh, W', S)`` of the last ``last`` queries (all held ones by default) over the held
        keys, in float32: causal (a query reads keys at or before its position), empty and hidden slots read 0."""
        if self.queries is None:
            raise SettingsError(f"layer {self.layer}: this press declared queries = 0, so none were kept; set its "
                                f"queries attribute to how many recent queries it reads")
        q = self.queries if last is None else self.queries[:, :, -last:]
        qp = self.query_positions if last is None else self.query_positions[-last:]
        return attention(q, qp, self.keys, self.positions, self.valid, self.scale, self.softcap, self.sinks)


def attention(q: torch.Tensor, q_pos: torch.Tensor, keys: torch.Tensor, k_pos: torch.Tensor, valid: torch.Tensor,
              scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention ``(B, nh, T, S)`` in float32 of queries ``q`` ``(B, nh, T, w)`` at ``q_pos`` ``(T,)`` over
    ``keys`` ``(B, H, S, w)`` at ``k_pos`` ``(B, H, S)`` where ``valid``: what the model computes for those queries
    reading those keys (grouped queries read their KV head; learned ``sinks`` ``(nh,)`` take their share of each
    row and read nothing, as in the model's softmax)."""
    B, nh, T, w = q.shape
    H, S = keys.shape[1], keys.shape[2]
    g = nh // H
    scores = (q.float().reshape(B, H, g * T, w) @ keys.float().transpose(-1, -2)) * scale  # (B, H, g*T, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(B, H, g, T, S)
    allowed = valid[:, :, None, None, :] & (k_pos[:, :, None, None, :] <= q_pos.view(1, 1, 1, T, 1))
    scores = scores.masked_fill(~allowed, NEG)
    if sinks is not None:
        sink = sinks.float().view(1, H, g, 1, 1).expand(B, H, g, T, 1)
        return torch.cat([scores, sink], -1).softmax(-1)[..., :-1].reshape(B, nh, T, S)
    return scores.softmax(-1).nan_to_num(0.0).view(B, nh, T, S)


def in_position_order(valid: torch.Tensor, positions: torch.Tensor, x: torch.Tensor, fn) -> torch.Tensor:
    """``fn`` applied to ``x`` ``(B, heads, S)`` over each head's *held* slots sorted by position (empty and hidden
    slots moved to the end), the result put back in slot order: what a press that looks at neighbouring keys
    (pooling) needs, whatever the storage's gaps and order. ``valid`` and ``positions`` ``(B, H, S)`` with
    ``heads`` a multiple of ``H``."""
    reps = x.shape[1] // valid.shape[1]
    key = positions.masked_fill(~valid, torch.iinfo(positions.dtype).max)
    order = torch.sort(key, dim=-1, stable=True).indices.repeat_interleave(reps, dim=1)
    out = fn(x.gather(-1, order))
    return torch.empty_like(out).scatter_(-1, order, out)


def per_kv_head(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``(B, nh, ...)`` summed over each KV head's group of query heads: ``(B, H, ...)``."""
    B, nh = x.shape[:2]
    return x.reshape(B, kv_heads, nh // kv_heads, *x.shape[2:]).sum(2)
