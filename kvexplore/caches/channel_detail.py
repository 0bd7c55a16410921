"""What one part (the keys or the values) of a quantized layer holds, channel by channel, for the views: how large each
channel is as the model wrote it and as the quantizer saw it (after a pre-RoPE turn and a Hadamard rotation), and the
codes, scales and zero points of the block where the channel lost the most.

A channel far larger than the others (an outlier channel) stretches every scale it shares; a rotation spreads it over
all channels, which the two magnitudes show side by side. Read from the stored codes (what the cache holds): a magnitude
is within one quantization step of the one the model wrote."""

from __future__ import annotations

from dataclasses import dataclass

import torch

OUTLIER = 4.0  # a channel this many times its head's median channel (max |x|) or more is drawn as an outlier


@dataclass
class PartDetail:
    """``part``: "keys" or "values"; ``bits``, ``axis`` ("channel": a scale per channel over a block of tokens,
    "token": a scale per token over a group of channels) and ``group`` (tokens per block); per KV head and channel,
    ``(kv_heads, head_dim)``: ``written`` (max |x| as the model wrote it, over the quantized positions),
    ``quantized`` (max |x| where the codes are taken, None when that is the model's own channels), ``block`` (the
    block of ``group`` positions with the channel's largest error); and of that block, ``(kv_heads, head_dim, n)``:
    ``codes`` (n = group: the channel's code at each of the block's positions), ``scale`` and ``zero`` (n = 1 on the
    channel axis, one per position on the token axis)."""

    part: str
    bits: int
    axis: str
    group: int
    written: torch.Tensor
    quantized: torch.Tensor | None
    block: torch.Tensor
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    def outliers(self, which: str = "written") -> torch.Tensor:
        """``(kv_heads, head_dim)`` bool: the channels at least :data:`OUTLIER` times their head's median channel,
        as written or (``which="quantized"``) where the codes are taken."""
        m = self.written if which == "written" else self.quantized
        return m >= OUTLIER * m.median(-1, keepdim=True).values.clamp_min(1e-12)


def block_rows(t: torch.Tensor, block: torch.Tensor, group: int) -> torch.Tensor:
    """``t`` ``(kv_heads, positions, head_dim)``: for each head and channel the ``group`` rows of its ``block``,
    ``(kv_heads, head_dim, group)``."""
    rows = block[:, None, :] * group + torch.arange(group, device=t.device)[None, :, None]  # (H, group, D)
    return t.gather(1, rows).permute(0, 2, 1)
