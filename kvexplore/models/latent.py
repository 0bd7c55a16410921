"""DeepSeek's multi-head latent attention (MLA), reading a latent cache.

Per position the cache holds one vector of ``kv_lora_rank`` (the normalised compressed keys and values, ``c``) and
one rope key of ``qk_rope_head_dim`` shared by every head (``k_rope``), in the key and value slots of a layer cache
(:class:`kvexplore.config.layer_plan.LayerSpec`, ``latent``). With ``W`` the ``kv_b_proj`` weight viewed ``(heads,
qk_nope_head_dim + v_head_dim, kv_lora_rank)``, split into ``W_k`` and ``W_v``, a head's key is ``[W_k c, k_rope]``
and its value ``W_v c``. Two exact ways to attend: **decompressed** (every cached ``c`` expanded into per-head keys
and values each step, as transformers does) and **absorbed** (the default: ``W_k`` folded into the query and ``W_v``
into the output, a head's score ``(W_k^T q_nope) . c + q_rope . k_rope`` and its output ``W_v (sum_s p_s c_s)``, so
attention reads the latents directly and nothing per head is materialised).

DeepSeek-V3.2 adds sparse attention (DSA): a small :class:`Indexer` scores the cached positions and each query
reads only its ``index_topk`` best; its key is cached next to the rope key, and a decode step reads a gather of
those positions and tells the cache which. Checked against transformers 5.24 in tests/engine/test_parity_latent.py.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attend import weigh_values
from .blocks import RMSNorm
from ..caches.base import KVCache
from ..caches.masks import positions_mask
from ..config.model_config import ModelConfig
from ..core.hooks import hook
from ..config.layer_plan import LayerSpec
from .rope import rotate


# transformers builds the q and kv latent norms with RMSNorm's default eps, not the config's rms_norm_eps
LATENT_NORM_EPS = 1e-6


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs ``(x0, x1), (x2, x3), ...``, written back de-interleaved (evens, then odds), as
    transformers' ``apply_rotary_pos_emb_interleave`` does; ``cos``/``sin`` are ``cat(freqs, freqs)``."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * c - odd * s, odd * c + even * s], dim=-1)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: scores every cached position for each query and keeps the top k.

    ``I[t, s] = sum_h w[t, h] * relu(q_I[t, h] . k_I[s] / sqrt(d_I))`` with ``w = weights_proj(x) / sqrt(heads)``,
    ``q_I = wq_b(compressed query)`` and one key per position ``k_I = LayerNorm(wk(x))`` (stored in the cache beside
    the rope key); both turn the first ``qk_rope_head_dim`` channels by plain (not interleaved) RoPE."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads, self.dim, self.rope, self.topk = (config.index_heads, config.index_head_dim,
                                                       config.qk_rope_head_dim, config.index_topk)
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The indexer key of each new position, ``(B, 1, T, dim)``, as the cache stores it."""
        return rotate(self.k_norm(self.wk(x)).unsqueeze(1), cos, sin)

    def select(self, x: torch.Tensor, q_compressed: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """The key columns each query reads, ``(B, T, k)``: the top ``index_topk`` by score of those it may read
        (``allowed``, ``(T, S)``)."""
        B, T, _ = x.shape
        S = keys.shape[2]
        q = rotate(self.wq_b(q_compressed).view(B, T, self.heads, self.dim).transpose(1, 2), cos, sin)  # (B,h,T,d)
        scores = torch.relu(q.float() @ keys.float().transpose(-1, -2) * self.dim ** -0.5)  # (B, h, T, S)
        weights = self.weights_proj(x).float() * self.heads ** -0.5  # (B, T, h)
        index = torch.einsum("bth,bhts->bts", weights, scores)
        index = index.masked_fill(~allowed, float("-inf"))
        return index.topk(min(self.topk, S), dim=-1).indices


class LatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        c, d = config, config.hidden_size
        self.layer, self.nh = spec.index, c.num_heads
        self.nope, self.rope, self.vd, self.rank = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        bias = c.o_bias
        if c.q_lora_rank:
            self.q_a_proj = nn.Linear(d, c.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS, c.norm_style)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.nh * c.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(d, self.nh * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, c.norm_style)
        self.kv_b_proj = nn.Linear(self.rank, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, d, bias=bias)
        self.low_rank_q, self.interleave, self.absorbed = bool(c.q_lora_rank), c.rope_interleave, c.mla == "absorbed"
        self.scale = c.attention_scale(spec.index)
        self.sparse = bool(c.index_topk)
        if self.sparse:
            self.indexer = Indexer(c)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_interleaved(x, cos, sin) if self.interleave else rotate(x, cos, sin)

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                tracer: Any) -> torch.Tensor:
        B, T, _ = x.shape
        q_compressed = self.q_a_layernorm(self.q_a_proj(x)) if self.low_rank_q else None
        q = self.q_b_proj(q_compressed) if self.low_rank_q else self.q_proj(x)
        q = q.view(B, T, self.nh, self.nope + self.rope).transpose(1, 2)  # (B, nh, T, nope + rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = self._rotate(q_rope, cos, sin)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c).view(B, 1, T, self.rank)  # one "head": shared by every query head
        k_rope = self._rotate(k_rope.view(B, 1, T, self.rope), cos, sin)
        name = f"layers.{self.layer}.attn"
        if tracer is not None:
            q_rope = hook(tracer, f"{name}.q", q_rope)
            c, k_rope = hook(tracer, f"{name}.k_new", c), hook(tracer, f"{name}.v_new", k_rope)
            c = hook(tracer, f"{name}.cache_write", c)
        stored = k_rope if not self.sparse else torch.cat([k_rope, self.indexer.key(x, cos, sin)], dim=-1)
        c_all, second = cache.write(self.layer, pos, c, stored)  # (B, 1, S, rank), (B, 1, S, rope [+ index])
        k_rope_all = second[..., : self.rope]
        mask = cache.mask(self.layer, pos, T)
        if self.sparse:  # DeepSeek-V3.2: each query reads only the indexer's top k positions
            # the columns each query may read: the cache's mask, or causal where its columns are positions 0..S-1
            allowed = mask if mask is not None else positions_mask(
                torch.arange(pos, pos + T, device=x.device), torch.arange(second.shape[2], device=x.device), None)
            chosen = self.indexer.select(x, q_compressed, second[..., self.rope:], cos, sin, allowed)
            c_all, k_rope_all, mask = self._sparse(cache, c_all, k_rope_all, chosen, allowed, T)
        if tracer is not None:
            c_all = hook(tracer, f"{name}.cache_read", c_all)
        explicit = tracer is not None and tracer.wants_attention(self.layer)
        attend = self._absorbed if self.absorbed else self._decompressed
        y = attend(q_nope, q_rope, c_all, k_rope_all, mask, tracer if explicit else None, name)
        out = self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.vd))
        return out if tracer is None else hook(tracer, f"{name}.out", out)

    def _sparse(self, cache: KVCache, c_all: torch.Tensor, k_rope_all: torch.Tensor, chosen: torch.Tensor,
                allowed: torch.Tensor, T: int):
        """One token of one sequence reads a gather of the chosen positions (the cache is told which, so the cache
        map marks exactly those); several tokens read every position under a mask of what each query chose."""
        B, _, S, _ = c_all.shape
        if T == 1 and B == 1:
            positions = chosen[0, 0].sort().values
            c_sel, k_sel = c_all.index_select(2, positions), k_rope_all.index_select(2, positions)
            cache.note_reads(self.layer, positions, c_sel.nbytes + k_sel.nbytes)
            return c_sel, k_sel, None
        picked = torch.zeros(B, T, S, dtype=torch.bool, device=c_all.device).scatter_(-1, chosen, True)
        return c_all, k_rope_all, (picked & allowed).unsqueeze(1)  # (B, 1, T, S)

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_k`` ``(nh, nope, rank)`` and ``W_v`` ``(nh, vd, rank)`` from ``kv_b_proj``."""
        w = self.kv_b_proj.weight.unflatten(0, (self.nh, self.nope + self.vd))  # a view, any layout
        return w[:, : self.nope], w[:, self.nope:]

    def _absorbed(self, q_nope, q_rope, c_all, k_rope_all, mask, tracer, name) -> torch.Tensor:
        w_k, w_v = self._up()
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_k)  # the query in latent space
        query = torch.cat([q_latent, q_rope], dim=-1)  # (B, nh, T, rank + rope)
        key = torch.cat([c_all, k_rope_all], dim=-1)  # (B, 1, S, rank + rope): one key head for all queries
        context = _attend(query, key, c_all, mask, self.scale, tracer, name)  # (B, nh, T, rank)
        return torch.einsum("bhtr,hvr->bhtv", context, w_v)  # (B, nh, T, vd)

    def _decompressed(self, q_nope, q_rope, c_all, k_rope_all, mask, tracer, name) -> torch.Tensor:
        B, _, S, _ = c_all.shape
        kv = self.kv_b_proj(c_all[:, 0]).view(B, S, self.nh, self.nope + self.vd).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)  # (B, nh, S, nope), (B, nh, S, vd)
        key = torch.cat([k_nope, k_rope_all.expand(B, self.nh, S, self.rope)], dim=-1)
        return _attend(torch.cat([q_nope, q_rope], dim=-1), key, v, mask, self.scale, tracer, name)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
            tracer: Any, name: str) -> torch.Tensor:
    """Softmax attention of ``q`` (B, nh, T, d) over ``k``/``v`` with 1 or nh heads; probabilities materialised in
    float32 (and passed to the tracer's ``scores`` and ``probs`` points) when a tracer asks. The output is SDPA's
    unless a hook replaced the scores or the probabilities: a trace does not change what it observes."""
    T, S = q.shape[2], k.shape[2]
    if tracer is not None:
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale  # (B, nh, T, S); k broadcasts over heads
        causal = mask
        if causal is None and T > 1:
            causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        if causal is not None:
            scores = scores.masked_fill(~causal, float("-inf"))
        observed = hook(tracer, f"{name}.scores", scores)
        computed = observed.softmax(dim=-1)
        probs = hook(tracer, f"{name}.probs", computed)
        if observed is not scores or probs is not computed:
            return weigh_values(probs, v)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def bytes_per_token(config: ModelConfig, itemsize: int = 2, gqa_heads: int = 8) -> dict[str, int]:
    """What one position costs over all layers of a latent-attention model, in three layouts:

    - ``latent``: what kvexplore's latent cache holds (and transformers 5.24's): ``layers * (kv_lora_rank +
      qk_rope_head_dim) * itemsize`` (DeepSeek-V3.2: plus its indexer's key, ``index_head_dim``);
    - ``per_head``: the decompressed per-head keys and values (what transformers' DeepSeek code cached before
      version 5, and what the decompressed path rebuilds each step): ``layers * heads * (qk_head_dim + v_head_dim)``;
    - ``gqa``: a plain grouped-query layout of the same head sizes with ``gqa_heads`` key/value heads."""
    c = config
    index = c.index_head_dim if c.index_topk else 0
    return {"latent": c.num_layers * (c.kv_lora_rank + c.qk_rope_head_dim + index) * itemsize,
            "per_head": c.num_layers * c.num_heads * (c.qk_head_dim + c.v_head_dim) * itemsize,
            "gqa": c.num_layers * gqa_heads * (c.qk_head_dim + c.v_head_dim) * itemsize}
