"""Cache bugs planted in small transformers Cache subclasses or a patched rotary embedding, for the doctor to find.

Each plant returns ``(model, cache)`` ready for ``kvexplore.doctor(model, prompt=PROMPT, cache=cache)``; the
comment says where the bug first shows (steps numbered as StepRecord.step: 0 is the token after prefill)."""

from __future__ import annotations

import torch
import transformers

PROMPT = [1, 5, 9, 20, 33, 4, 7]  # 7 tokens: step s feeds position 6 + s


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class OffByOne(transformers.DynamicCache):
    """get_seq_length answers one more than it holds once something is cached: every decode step's position ids
    (hence RoPE) are one too far. First shows at step 1, layer 0."""

    def get_seq_length(self, layer_idx: int = 0) -> int:
        n = super().get_seq_length(layer_idx)
        return n + 1 if n else 0


class KeysBeforeRope(transformers.DynamicCache):
    """Stores (and gives attention) the keys un-rotated: RoPE undone before the write. Shows at step 0, layer 0."""

    def __init__(self, model, **kwargs) -> None:
        super().__init__(config=model.config, **kwargs)
        self.rotary = model.model.rotary_emb

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        start = self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0
        pos = torch.arange(start, start + key_states.shape[-2])[None]
        cos, sin = self.rotary(key_states, pos)
        cos, sin = cos[:, None], sin[:, None]
        plain = key_states * cos - _rotate_half(key_states) * sin  # the inverse turn
        return super().update(plain, value_states, layer_idx, *args, **kwargs)


class ValuesAreKeys(transformers.DynamicCache):
    """From sequence length ``start`` on, layer ``layer`` stores the new keys in the values' place."""

    def __init__(self, model, layer: int, start: int) -> None:
        super().__init__(config=model.config)
        self.layer, self.start = layer, start

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if (layer_idx == self.layer and key_states.shape[-2] == 1
                and self.layers[layer_idx].get_seq_length() >= self.start):
            value_states = key_states
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class HalfWindow(transformers.DynamicCache):
    """Gemma 3's sliding layers built with half their window: the cache drops keys the window still needs (the
    window applied twice). First shows when the sequence outgrows the half window, on the first sliding layer."""

    def __init__(self, model) -> None:
        super().__init__(config=model.config)
        for i, layer in enumerate(self.layers):
            if isinstance(layer, transformers.cache_utils.DynamicSlidingWindowLayer):
                self.layers[i] = transformers.cache_utils.DynamicSlidingWindowLayer(
                    sliding_window=layer.sliding_window // 2)


class LateWrite(transformers.StaticCache):
    """From sequence length ``start`` on, each new key and value lands one slot late: attention reads the slot the
    position should have (never written: zeros) and the real one is masked."""

    def __init__(self, model, max_cache_len: int, start: int) -> None:
        super().__init__(config=model.config, max_cache_len=max_cache_len)
        self.start = start

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        n = layer.get_seq_length() if layer.is_initialized else 0
        n = int(n)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[-2] == 1 and n >= self.start:
            for t in (layer.keys, layer.values):
                t[:, :, n + 1] = t[:, :, n]
                t[:, :, n] = 0
        return keys, values


def missing_rope_offset(model) -> None:
    """Patch the model's rotary embedding so positions restart at 0 in every pass: a cached step turns its key as if
    at position 0. First shows at step 1, layer 0."""
    rotary = model.model.rotary_emb
    inner = rotary.forward

    def forward(x, position_ids, *args, **kwargs):
        return inner(x, position_ids - position_ids[:, :1], *args, **kwargs)

    rotary.forward = forward
