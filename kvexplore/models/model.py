"""A decoder of the Llama family and its 2025 descendants (Llama 1/2/3, Mistral, Qwen2, Qwen3, Gemma 3) whose KV
cache is an object passed into ``forward``: it gives every layer the keys it must read and their mask
(:meth:`~kvexplore.KVCache.mask`); a shared layer reads its source's with :meth:`~kvexplore.KVCache.read_shared`.

Parameter names follow Hugging Face (``model.layers.3.self_attn.q_proj.weight`` ...) so a checkpoint loads by a 1:1
key check. Shapes in comments: B batch, T new tokens, S positions attention reads, nh query heads, nkv key/value
heads, g = nh // nkv, hd head dim, D hidden size. Internals pass through named hook points
(:func:`hook_point_names`): a ``tracer`` has ``hook(name, tensor) -> tensor | None`` (a tensor replaces the value)
and ``wants_attention(layer) -> bool`` (explicit probabilities for that layer); with no tracer none of this runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..caches.base import KVCache
from ..caches.one_pass import one_pass
from ..config.model_config import ModelConfig
from ..config.families import Architecture, lookup
from ..config.layer_plan import LayerSpec, layer_plan
from .architectures import llama as _llama  # importing the package registers every architecture
from .blocks import MLP, RMSNorm
from ..core import host
from .attend import soft_cap, softmax_with_sinks, weigh_values
from .observe import observe, observes_rows
from ..core.hooks import hook
from .rope import Rotary, rotate
from ..errors import SettingsError, UnsupportedModelError

# hook points of one layer, in the order they fire; the model's full list is embed, layers..., norm, logits
LAYER_HOOK_POINTS = ("attn.q", "attn.k_new", "attn.v_new", "attn.cache_write", "attn.cache_read", "attn.scores",
                     "attn.probs", "attn.out", "mlp.out")


#: what ``nn.Linear``, ``nn.Embedding`` and friends initialise their weights with
_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")


@contextmanager
def _no_init() -> Iterator[None]:
    """Modules built without random initialisation (as transformers' ``no_init_weights``): on the meta device a
    tensor's ``normal_`` runs torch's Python reference, which imports the compiler (dynamo and inductor) into a
    process that only loads and decodes."""
    saved = {name: getattr(nn.init, name) for name in _INITS}
    for name in _INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(nn.init, name, function)


def hook_point_names(num_layers: int) -> list[str]:
    """Every hook point of a model with ``num_layers`` layers, in firing order."""
    per_layer = [f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_HOOK_POINTS]
    return ["embed", *per_layer, "norm", "logits"]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.layer, self.spec = spec.index, spec
        self.nh, self.nkv, self.hd = config.num_heads, spec.kv_heads, spec.head_dim
        d = config.hidden_size
        self.gated = config.gated_attention  # Qwen3-Next: each head's queries come with an output gate
        self.q_proj = nn.Linear(d, self.nh * self.hd * (2 if self.gated else 1), bias=config.qkv_bias)
        self.k_proj = nn.Linear(d, self.nkv * self.hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, self.nkv * self.hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, d, bias=config.o_bias)
        shared = spec.shares
        if shared:  # a shared layer computes queries only (transformers' checkpoints hold no k/v weights for it)
            del self.k_proj, self.v_proj
        eps, style = config.rms_norm_eps, config.norm_style
        if config.qk_norm:  # one RMSNorm over each head's channels, before RoPE
            self.q_norm = RMSNorm(self.hd, eps, style)
            if not shared:
                self.k_norm = RMSNorm(self.hd, eps, style)
        self.v_norm = RMSNorm(self.hd, eps, style, scale=False) if config.v_norm else None
        self.qk_norm = config.qk_norm
        self.scale = config.attention_scale(spec.index)
        self.softcap = config.attn_logit_softcapping
        if config.attention_sinks:  # one learned logit per query head, in every softmax's denominator
            self.sinks = nn.Parameter(torch.zeros(self.nh))
        self.has_sinks = config.attention_sinks

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                tracer: Any) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, -1)
        gate = None
        if self.gated:  # per head [query | gate]
            q, gate = q[..., : self.hd], q[..., self.hd:].reshape(B, T, self.nh * self.hd)
        if self.qk_norm:
            q = self.q_norm(q)
        q = rotate(q.transpose(1, 2), cos, sin)  # (B, nh, T, hd)
        name = f"layers.{self.layer}.attn"
        if tracer is not None:
            q = hook(tracer, f"{name}.q", q)
        if self.spec.shares:  # no keys of its own: read what the source layer's attention read
            k_all, v_all = cache.read_shared(self.layer)
        else:
            k = self.k_proj(x).view(B, T, self.nkv, self.hd)
            if self.qk_norm:
                k = self.k_norm(k)
            k = rotate(k.transpose(1, 2), cos, sin)  # (B, nkv, T, hd): keys are cached after RoPE
            v = self.v_proj(x).view(B, T, self.nkv, self.hd)
            if self.v_norm is not None:
                v = self.v_norm(v)
            v = v.transpose(1, 2)  # (B, nkv, T, hd)
            if tracer is not None:
                k, v = hook(tracer, f"{name}.k_new", k), hook(tracer, f"{name}.v_new", v)
                k = hook(tracer, f"{name}.cache_write", k)  # the keys about to be stored (values travel with them)
            if (ev := cache.eviction) is not None and ev.reads_queries(self.layer):  # a press reads the queries
                k_all, v_all = cache.write(self.layer, pos, k, v, queries=q)
            else:  # a cache of one's own may take no queries (notebook 07's subclasses write without them)
                k_all, v_all = cache.write(self.layer, pos, k, v)  # (B, nkv, S, hd)
        if tracer is not None:
            k_all = hook(tracer, f"{name}.cache_read", k_all)  # the keys attention reads, as the cache gave them
        mask = cache.mask(self.layer, pos, T)
        y = self.attend(q, k_all, v_all, mask, tracer, name)
        y = y.transpose(1, 2).reshape(B, T, self.nh * self.hd)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        out = self.o_proj(y)
        return out if tracer is None else hook(tracer, f"{name}.out", out)

    def attend(self, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: torch.Tensor | None,
               tracer: Any, name: str) -> torch.Tensor:
        """Attention of the queries ``(B, nh, T, hd)`` over the keys and values the cache gave: ``(B, nh, T, hd)``
        (context parallelism overrides it to merge the ranks' shares, :mod:`kvexplore.distributed.context`)."""
        T = q.shape[2]
        y = None
        wanted = tracer is not None and tracer.wants_attention(self.layer)
        if wanted and observes_rows(tracer):  # the tracer takes the probabilities in chunks of rows
            if self.softcap is not None or self.has_sinks:
                y = self._explicit(q, k_all, v_all, mask, None, name)
            observe(tracer, self.layer, q, k_all, mask, self.scale, self.softcap,
                    self.sinks if self.has_sinks else None)
        elif self.softcap is not None or self.has_sinks or wanted:
            y = self._explicit(q, k_all, v_all, mask, tracer, name)
        if y is None:
            # grouped-query attention without a repeat_kv copy of K/V
            if mask is not None and mask.dim() == 4:  # a mask per KV head: one per query head for SDPA
                mask = mask.repeat_interleave(self.nh // self.nkv, dim=1)
            y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=mask is None and T > 1,
                                               scale=self.scale, enable_gqa=True)  # (B, nh, T, hd)
        return y

    def _explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  tracer: Any, name: str) -> torch.Tensor | None:
        """Attention with the probabilities materialised (in float32), for the layers a tracer asks about, and for
        soft-capped scores and learned sinks, which SDPA cannot compute. With sinks, ``attn.probs`` sums to less
        than 1 per row: the rest is the sink's share, which reads no value.

        Returns the attention output, or None when SDPA can compute it (no softcap, no sinks, and no hook replaced
        the scores or the probabilities): a trace must not change what it observes, and SDPA's rounding in
        bfloat16 and float16 is not a materialised softmax's."""
        B, nh, T, hd = q.shape
        S, g = k.shape[2], nh // self.nkv
        # query head h reads kv head h // g: stack each group's queries as rows, so K/V are read, never repeated
        qg = q.reshape(B, self.nkv, g * T, hd)  # rows ordered (head in group, token)
        scores = (qg.float() @ k.float().transpose(-1, -2)) * self.scale  # (B, nkv, g*T, S), in float32 as SDPA
        scores = soft_cap(scores, self.softcap)
        if mask is None and T > 1:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        if mask is not None:  # one token needs none: it may read every position held
            rows = mask.repeat(g, 1) if mask.dim() == 2 else mask.repeat(1, 1, g, 1)  # (.., g*T, S) as the scores
            scores = scores.masked_fill(~rows, float("-inf"))
        scores = scores.view(B, nh, T, S)
        observed = scores
        if tracer is not None:
            scores = hook(tracer, f"{name}.scores", scores)
        probs = softmax_with_sinks(scores, self.sinks if self.has_sinks else None)  # (B, nh, T, S)
        computed = probs
        if tracer is not None:
            probs = hook(tracer, f"{name}.probs", probs)
        if self.softcap is None and not self.has_sinks and scores is observed and probs is computed:
            return None  # only observed: the output is SDPA's, as without a tracer
        y = weigh_values(probs.reshape(B, self.nkv, g * T, S), v)  # (B, nkv, g*T, hd)
        return y.view(B, nh, T, hd)


def architecture(config: ModelConfig) -> Architecture:
    """The registered entry of ``config.architecture``; a config built by hand for an unregistered name (a display
    config of :mod:`kvexplore.hf`) gets the Llama blocks."""
    return lookup(config.architecture) or _llama.LLAMA


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.layer = spec.index
        d, eps, style = config.hidden_size, config.rms_norm_eps, config.norm_style
        self.input_layernorm = RMSNorm(d, eps, style)
        arch = architecture(config)
        if spec.recurrent:  # transformers names the linear-attention mixer linear_attn
            if arch.recurrent is None:
                raise UnsupportedModelError(f"{config.source}: layer {spec.index} is a linear-attention layer, which "
                                            f"{config.architecture} does not implement")
            self.linear_attn = arch.recurrent(config, spec.index)
        else:
            self.self_attn = (arch.attention or Attention)(config, spec)
        self.linear = spec.recurrent
        self.post_attention_layernorm = RMSNorm(d, eps, style)
        self.sandwich = config.sandwich_norms
        if self.sandwich:  # Gemma normalises each sublayer's input and output: four norms per layer
            self.pre_feedforward_layernorm = RMSNorm(d, eps, style)
            self.post_feedforward_layernorm = RMSNorm(d, eps, style)
        self.mlp = _mlp(config, spec.index)
        if config.layer_scalar:  # Gemma 4: a stored scalar (a buffer in the checkpoint) scales the whole output
            self.register_buffer("layer_scalar", torch.ones(1))
        self.scaled = config.layer_scalar

    def forward(self, x: torch.Tensor, cache: KVCache, pos: int, cos: torch.Tensor, sin: torch.Tensor,
                tracer: Any) -> torch.Tensor:
        mixer = self.linear_attn if self.linear else self.self_attn
        a = mixer(self.input_layernorm(x), cache, pos, cos, sin, tracer)
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            m = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        else:
            x = x + a
            m = self.mlp(self.post_attention_layernorm(x))
        if tracer is not None:
            m = hook(tracer, f"layers.{self.layer}.mlp.out", m)
        return (x + m) * self.layer_scalar if self.scaled else x + m


def _mlp(config: ModelConfig, layer: int) -> nn.Module:
    """The layer's feed-forward block: the architecture's experts where the config puts experts (gpt-oss's,
    DeepSeek's after its first dense layers, Qwen3-Next's), else its dense MLP (the gated one by default)."""
    arch = architecture(config)
    if not config.uses_experts(layer):
        return (arch.mlp or MLP)(config, config.layer_intermediate_size(layer))
    if arch.experts is None:
        raise UnsupportedModelError(f"{config.source}: layer {layer} has experts (num_experts "
                                    f"{config.num_experts}), which {config.architecture} does not implement")
    return arch.experts(config)


class Decoder(nn.Module):
    """The ``model.`` part of a Hugging Face checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, spec) for spec in layer_plan(config))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_style)


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

    @classmethod
    def skeleton(cls, config: ModelConfig) -> "Model":
        """A model of ``config`` whose tensors are on the meta device: no memory and no initialisation, the names and
        shapes a checkpoint must have (its state dict loads with ``assign=True``)."""
        with torch.device("meta"), _no_init():
            return cls(config)

    def first_layers(self, n: int) -> "Model":
        """A model made of this one's first ``n`` layers, then its final norm and output head: the same weights
        (nothing copied), ``n / num_layers`` of the work. What self-speculative decoding drafts with (LayerSkip's
        early exit); its logits are a guess of the full model's, not equal to them."""
        N = self.config.num_layers
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= N:
            raise SettingsError(f"first_layers({n!r}): give a number of layers 1..{N}")
        c = self.config
        shared_from = N - c.num_kv_shared_layers  # the first layer that reads an earlier layer's cache
        config = replace(c, num_layers=n, layer_types=list(c.layer_types[:n]),
                         num_kv_shared_layers=max(0, n - shared_from),
                         layer_head_dims={i: d for i, d in c.layer_head_dims.items() if i < n},
                         layer_kv_head_counts={i: h for i, h in c.layer_kv_head_counts.items() if i < n},
                         dense_layers=[i for i in c.dense_layers if i < n])
        twin = Model.__new__(Model)
        nn.Module.__init__(twin)
        decoder = Decoder.__new__(Decoder)
        nn.Module.__init__(decoder)
        decoder.embed_tokens, decoder.norm = self.model.embed_tokens, self.model.norm
        decoder.layers = nn.ModuleList(list(self.model.layers)[:n])
        twin.config, twin.model, twin.lm_head, twin.rotary = config, decoder, self.lm_head, self.rotary
        twin.tokenizer, twin.source = self.tokenizer, f"{self.source or c.architecture} (first {n} of {N} layers)"
        if "project" in vars(self):  # the kernels applied to this model: its layers' already are the twin's
            twin.project = self.project
        return twin

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``(B, T, D)`` the first layer reads."""
        x = self.model.embed_tokens(ids)
        if self.config.embed_scale:  # scaled by sqrt(hidden), rounded to the dtype first as transformers does
            x = x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)
        return x

    #: the output head's matrix product; :func:`kvexplore.fast.kernels.apply` gives a model a faster one of its own
    project = staticmethod(F.linear)

    @property
    def head_weight(self) -> torch.Tensor:
        """The output head's weight ``[vocab, hidden]``: the embeddings where they are tied."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final norm's output ``x``."""
        return self.capped(self.project(x, self.head_weight).float())

    def capped(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output as the model gives it: soft-capped where the config says so (Gemma 2)."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, cache: KVCache, pos: int, tracer: Any = None,
                last_only: bool = False, keep_undo: bool = False) -> torch.Tensor:
        """Run ``ids`` ``[batch, seq]`` at positions ``pos..pos+seq-1``, writing their K/V into ``cache``.

        Returns float32 logits ``[batch, seq, vocab]`` (``[batch, 1, vocab]`` with ``last_only``: the output head over a
        long prompt is a large share of its cost). Raises before touching the cache if the ids, the position or the
        cache do not fit; a failed call leaves the cache as it was. ``keep_undo`` keeps what ``cache.rollback()`` needs
        until ``cache.settle()``; by default nothing outlives the pass.
        """
        self._check_inputs(ids, cache, pos)
        B, T = ids.shape
        with one_pass(cache, pos, T, B, self, keep_undo):
            x = self.embed(host.upload(ids, self.device))  # (B, T, D)
            if tracer is not None:
                x = hook(tracer, "embed", x)
            types = self.config.layer_types
            angles = {t: self.rotary.cos_sin(pos, T, x.dtype, t) for t in dict.fromkeys(types)}
            for layer, layer_type in zip(self.model.layers, types):
                x = layer(x, cache, pos, *angles[layer_type], tracer)
            if last_only:
                x = x[:, -1:]
            x = self.model.norm(x)
            if tracer is not None:
                x = hook(tracer, "norm", x)
            logits = self.logits(x)  # (B, T, vocab)
            if tracer is not None:
                logits = hook(tracer, "logits", logits)
        return logits

    def _check_inputs(self, ids: torch.Tensor, cache: KVCache, pos: int) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise SettingsError(f"ids must be an integer tensor [batch, seq], got {got}; use ids[None] for one "
                                f"sequence")
        if ids.shape[1] == 0:
            raise SettingsError("ids has no tokens (seq length 0); pass at least one token")
        lo, hi = (int(v) for v in host.fetch(list(torch.aminmax(ids))))  # the generator's ids are on the host
        if lo < 0 or hi >= self.config.vocab_size:
            bad = lo if lo < 0 else hi
            raise SettingsError(f"token id {bad} is outside the vocabulary (0..{self.config.vocab_size - 1})")
        if cache.dtype != self.dtype or cache.device != self.device:
            raise SettingsError(
                f"cache holds {cache.dtype} on {cache.device} but the model runs {self.dtype} on {self.device}; "
                f"create the cache with dtype=model.dtype, device=model.device"
            )
