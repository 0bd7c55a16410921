"""A Llama-family decoder (Llama 1/2/3, Mistral, Qwen2) whose KV cache is an object passed into ``forward``.

Parameter names follow Hugging Face (``model.layers.3.self_attn.q_proj.weight`` ...) so a checkpoint loads
by a 1:1 key check. Shapes in comments: B batch, T new tokens, S positions attention reads, nh query heads,
nkv key/value heads, g = nh // nkv query heads per kv head, hd head dim, D hidden size.

Internals pass through named hook points (``embed``, ``layers.3.attn.q``, ...; see :func:`hook_point_names`).
A ``tracer`` is any object with ``hook(name, tensor) -> tensor | None`` (return a tensor to replace the value)
and ``wants_attention(layer) -> bool`` (compute explicit attention probabilities for that layer); a
:class:`kvexplore.Tracer` records them. ``cache_write`` carries the keys about to be stored, ``cache_read`` the
keys attention reads (values travel with them). With no tracer none of this runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .caches.base import KVCache
from .config import ModelConfig
from .rope import Rotary, rotate
from .errors import SettingsError

# hook points of one layer, in the order they fire; the model's full list is embed, layers..., norm, logits
LAYER_HOOK_POINTS = ("attn.q", "attn.k_new", "attn.v_new", "attn.cache_write", "attn.cache_read", "attn.scores",
                     "attn.probs", "attn.out", "mlp.out")


def hook_point_names(num_layers: int) -> list[str]:
    """Every hook point of a model with ``num_layers`` layers, in firing order."""
    per_layer = [f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_HOOK_POINTS]
    return ["embed", *per_layer, "norm", "logits"]


def _hook(tracer: Any, name: str, t: torch.Tensor) -> torch.Tensor:
    replaced = tracer.hook(name, t)
    return t if replaced is None else replaced


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 and cast back before the weight, as transformers does (matters in bf16/fp16)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(d, f, bias=bias)
        self.up_proj = nn.Linear(d, f, bias=bias)
        self.down_proj = nn.Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.nh, self.nkv, self.hd = config.num_heads, config.num_kv_heads, config.head_dim
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.nh * self.hd, bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.nkv * self.hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.nkv * self.hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, d, bias=config.o_bias)
        self.scale = self.hd ** -0.5

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, tracer: Any) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # keys are cached after RoPE
        name = f"layers.{self.layer}.attn"
        if tracer is not None:
            q, k, v = _hook(tracer, f"{name}.q", q), _hook(tracer, f"{name}.k_new", k), _hook(tracer, f"{name}.v_new", v)
            k = _hook(tracer, f"{name}.cache_write", k)  # the keys about to be stored (values travel with them)
        k_all, v_all = cache.write(self.layer, pos, k, v)  # (B, nkv, S, hd), S = pos + T
        if tracer is not None:
            k_all = _hook(tracer, f"{name}.cache_read", k_all)  # the keys attention reads, as the cache gave them
        if tracer is not None and tracer.wants_attention(self.layer):
            y = self._explicit(q, k_all, v_all, mask, tracer, name)
        else:
            # grouped-query attention without a repeat_kv copy of K/V
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=mask is None and T > 1,
                                               enable_gqa=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        out = self.o_proj(y)
        return out if tracer is None else _hook(tracer, f"{name}.out", out)

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  tracer: Any, name: str) -> torch.Tensor:
        """Attention with the probabilities materialised, for the layers a tracer asks about."""
        B, nh, T, hd = q.shape
        S, g = k.shape[2], nh // self.nkv
        # query head h reads kv head h // g: stack each group's queries as rows, so K/V are read, never repeated
        qg = q.reshape(B, self.nkv, g * T, hd)  # rows ordered (head in group, token)
        scores = (qg @ k.transpose(-1, -2)).float() * self.scale  # (B, nkv, g*T, S)
        if mask is None and T > 1:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        if mask is not None:  # one token needs none: it may read every position held
            scores = scores.masked_fill(~mask.repeat(g, 1), float("-inf"))
        scores = _hook(tracer, f"{name}.scores", scores.view(B, nh, T, S))
        probs = _hook(tracer, f"{name}.probs", scores.softmax(dim=-1))  # (B, nh, T, S)
        y = probs.to(v.dtype).reshape(B, self.nkv, g * T, S) @ v  # (B, nkv, g*T, hd)
        return y.view(B, nh, T, hd)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, tracer: Any) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, pos, cos, sin, mask, tracer)
        m = self.mlp(self.post_attention_layernorm(x))
        if tracer is not None:
            m = _hook(tracer, f"layers.{self.layer}.mlp.out", m)
        return x + m


class Decoder(nn.Module):
    """The ``model.`` part of a Hugging Face checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def attention_mask(pos: int, q_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean ``(T, S)`` mask of which cached positions each new query may read, or ``None`` when plain causal
    attention with the queries at the end (SDPA's ``is_causal`` for T > 1, nothing for T == 1) is exact."""
    kv_len = pos + q_len
    windowed = window is not None and kv_len > window
    if not windowed and (q_len == 1 or pos == 0):
        return None
    q_pos = torch.arange(pos, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if windowed:
        allowed &= k_pos > q_pos - window
    return allowed


class Model(nn.Module):
    """A loaded decoder: ``model(ids, cache, pos) -> logits``. Build one with :func:`kvexplore.load`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                          bias=False)
        self.rotary = Rotary(config)
        self.tokenizer = None  # set by the loader
        self.source: str | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: KVCache, pos: int, tracer: Any = None,
                last_only: bool = False, keep_undo: bool = False) -> torch.Tensor:
        """Run ``ids`` ``[batch, seq]`` at positions ``pos..pos+seq-1``, writing their K/V into ``cache``.

        Returns logits ``[batch, seq, vocab]`` in float32 (``[batch, 1, vocab]`` for the last position only with
        ``last_only``: generation needs no more, and the output head over a long prompt is a large share of its
        cost). Raises before touching the cache if the ids, the position or the cache do not fit; a failed call
        leaves the cache as it was (rolled back if some layers wrote). ``keep_undo`` keeps what
        ``cache.rollback()`` needs after the pass succeeded (the generator uses it while it picks the token); by
        default it is dropped at once, so nothing outlives the pass (a concatenating cache holds one storage).
        """
        self._check_inputs(ids, cache, pos)
        B, T = ids.shape
        cache.check_write(pos, T, B)
        cache.begin_step()
        try:
            x = self.model.embed_tokens(ids.to(self.device))  # (B, T, D)
            if tracer is not None:
                x = _hook(tracer, "embed", x)
            cos, sin = self.rotary.cos_sin(pos, T, x.dtype)
            mask = attention_mask(pos, T, self.config.sliding_window, x.device)
            for layer in self.model.layers:
                x = layer(x, cache, pos, cos, sin, mask, tracer)
            if last_only:
                x = x[:, -1:]
            x = self.model.norm(x)
            if tracer is not None:
                x = _hook(tracer, "norm", x)
            head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(x, head).float()  # (B, T, vocab)
            if tracer is not None:
                logits = _hook(tracer, "logits", logits)
        except BaseException:
            cache.rollback()  # some layers may have written: put the cache back exactly as it was
            raise
        cache.commit(pos + T)
        if not keep_undo:
            cache.settle()
        return logits

    def _check_inputs(self, ids: torch.Tensor, cache: KVCache, pos: int) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise SettingsError(f"ids must be an integer tensor [batch, seq], got {got}; use ids[None] for one sequence")
        if ids.shape[1] == 0:
            raise SettingsError("ids has no tokens (seq length 0); pass at least one token")
        lo, hi = (int(v) for v in torch.aminmax(ids))  # one sync; the generator passes CPU ids, so none on CUDA
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise SettingsError(f"token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if cache.dtype != self.dtype or cache.device != self.device:
            raise SettingsError(
                f"cache holds {cache.dtype} on {cache.device} but the model runs {self.dtype} on {self.device}; "
                f"create the cache with dtype=model.dtype, device=model.device"
            )
