"""Rotary position embedding (RoPE), in the Hugging Face "rotate half" convention (channel j turns with j + d/2).

Keys are rotated *before* they are written to the cache, so a cached key already carries its position and is
never touched again. The inverse frequencies follow transformers for the ``linear``, ``llama3``, ``yarn`` (gpt-oss)
and ``proportional`` (Gemma 4's global layers: only some pairs turn) scalings, per layer type.
"""

from __future__ import annotations

import math

import torch

from ..config.model_config import ModelConfig


def inverse_frequencies(config: ModelConfig, layer_type: str = "full_attention") -> torch.Tensor:
    """``[head_dim // 2]`` float32 angular frequencies of the layers of ``layer_type``, after rope scaling."""
    dim = _head_dim(config, layer_type)
    theta, scaling = config.rope_for(layer_type)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if scaling is None:
        return inv_freq
    old_len = float(scaling.get("original_max_position_embeddings") or config.max_position_embeddings)
    return SCALINGS[scaling["rope_type"]](inv_freq, dim, theta, old_len, scaling)


def _proportional(inv_freq: torch.Tensor, dim: int, theta: float, old_len: float, scaling: dict) -> torch.Tensor:
    """Gemma 4's global layers: only the first ``partial_rotary_factor`` of the pairs turn."""
    turning = int(float(scaling.get("partial_rotary_factor") or 1.0) * dim // 2)
    inv_freq[turning:] = 0.0  # channels j and j + dim/2 of the others pass through (cos 1, sin 0)
    return inv_freq / float(scaling.get("factor") or 1.0)


def _linear(inv_freq: torch.Tensor, dim: int, theta: float, old_len: float, scaling: dict) -> torch.Tensor:
    return inv_freq / float(scaling["factor"])


def _llama3(inv_freq: torch.Tensor, dim: int, theta: float, old_len: float, scaling: dict) -> torch.Tensor:
    """Llama 3: long wavelengths are slowed by ``factor``, short ones kept, the band between interpolated."""
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _head_dim(config: ModelConfig, layer_type: str) -> int:
    """The channels RoPE turns in a head of the layers of ``layer_type`` (Qwen3-Next: the first quarter)."""
    dim = config.layer_head_dim(config.layer_types.index(layer_type)) if layer_type in config.layer_types \
        else config.head_dim
    return int(dim * config.rotary_fraction) if config.rotary_fraction < 1 else dim


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, old_len: float, scaling: dict) -> torch.Tensor:
    """YaRN (gpt-oss): frequencies that turn more than ``beta_fast`` times over the original context are kept,
    those turning fewer than ``beta_slow`` times are divided by ``factor``, with a linear ramp between."""
    def dims_for(turns: float) -> float:  # the pair index whose wavelength fits `turns` times in old_len
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dims_for(float(scaling.get("beta_fast") or 32)), dims_for(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return inv_freq / float(scaling["factor"]) * (1 - keep) + inv_freq * keep


#: the inverse frequencies of each rope scaling type config_fields.ROPE_FIELDS accepts (except "default", plain)
SCALINGS = {"proportional": _proportional, "linear": _linear, "llama3": _llama3, "yarn": _yarn}


def attention_factor(config: ModelConfig, layer_type: str = "full_attention") -> float:
    """What cos and sin are multiplied by (YaRN's ``0.1 ln(factor) + 1``; 1 for every other RoPE)."""
    _, scaling = config.rope_for(layer_type)
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(float(m)) / mscale(float(m_all)) if m and m_all else mscale()


class Rotary(torch.nn.Module):
    """Computes cos/sin for a run of positions and rotates q and k with them. Models whose local and global
    layers use different RoPE (Gemma 3: base 10k locally, 1M globally) hold one set of frequencies per type."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.own = tuple(t for t in dict.fromkeys(config.layer_types) if t != "full_attention")
        # float32 on the host, whatever .to() does to the model: a bfloat16 inv_freq turns position 1000 by a
        # visibly wrong angle. The buffers are these, moved to the model's device (see _apply).
        with torch.device("cpu"):  # on the host even inside a model built on the meta device (Model.skeleton)
            self._exact = {"inv_freq": inverse_frequencies(config),
                           **{f"inv_freq_{t}": inverse_frequencies(config, t) for t in self.own}}
        for name, table in self._exact.items():
            self.register_buffer(name, table.clone(), persistent=False)
        self.scale = {t: attention_factor(config, t) for t in ("full_attention", *self.own)}

    def _apply(self, fn, recurse: bool = True):
        """``.to(device, dtype)``, ``.half()``, ``.cuda()`` ...: the tables follow the device, never the dtype."""
        super()._apply(fn, recurse)
        for name, table in self._exact.items():
            self._buffers[name] = table.to(self._buffers[name].device)
        return self

    def cos_sin(self, pos: int, length: int, dtype: torch.dtype,
                layer_type: str = "full_attention") -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions ``pos .. pos + length - 1``, each ``[length, head_dim]``, for the layers of
        ``layer_type``."""
        inv_freq = getattr(self, f"inv_freq_{layer_type}") if layer_type in self.own else self.inv_freq
        t = torch.arange(pos, pos + length, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # (T, hd/2), computed in float32 like transformers
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        scale = self.scale.get(layer_type, 1.0)
        if scale != 1.0:
            return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        return emb.cos().to(dtype), emb.sin().to(dtype)


    def turn(self, x: torch.Tensor, delta: torch.Tensor, layer_type: str = "full_attention") -> torch.Tensor:
        """``x`` ``(..., hd)`` (keys already rotated) turned by ``delta`` ``(...)`` more positions each (negative:
        back): RoPE composes, so a key at ``p`` turned by ``d`` is the key rotated at ``p + d``. A pure rotation (no
        attention factor: the one applied at ``p`` stays)."""
        inv_freq = getattr(self, f"inv_freq_{layer_type}") if layer_type in self.own else self.inv_freq
        freqs = delta.to(inv_freq.device, torch.float32).unsqueeze(-1) * inv_freq  # (..., rot/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return rotate(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to ``x`` of shape ``(B, heads, T, hd)`` with ``cos``/``sin`` of shape ``(T, rot)``: the first
    ``rot`` channels turn (all of them unless the model rotates only part of each head), the rest pass."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([rotate(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
