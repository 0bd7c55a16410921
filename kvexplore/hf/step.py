"""One forward pass of a transformers model through an :class:`~.cache.HFCache`, watched (the keys and values each
layer's cache update received and returned, attention probabilities when a tracer wants them), fed to the tracer's
hook points after the pass under the names kvexplore's own model uses."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from . import watch


@contextmanager
def watching(hf_cache: object, pos: int, q_len: int, window=None):
    """Wrap the transformers cache's ``update`` (and state updates) for one pass; yields what they saw.
    ``window`` (a :class:`kvexplore.core.allocator.Window`) measures the CUDA allocator inside each update."""
    seen: dict[str, dict[int, object]] = {"new": {}, "read": {}, "values": {}, "reads": {}, "state": {}}
    inner_update = hf_cache.update
    inner_state = getattr(hf_cache, "update_recurrent_state", None)
    end = pos + q_len

    def update(key_states, value_states, layer_idx, *args, **kwargs):
        with window if window is not None else nullcontext():
            keys, values = inner_update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = hf_cache.layers[layer_idx]
        stored = watch.key_tensor(layer)
        if stored is not None and keys.data_ptr() == stored.data_ptr() and keys.shape == stored.shape:
            positions = watch.slot_positions(layer, end)  # attention read the storage itself: slot order
            valid = [p for p in positions if p >= 0]
            if positions[: len(valid)] != valid:  # free slots come last in every layer class read here
                valid = positions
        else:  # a new tensor (a concatenation): the last positions up to the newest
            valid = list(range(end - keys.shape[-2], end))
        seen["new"][layer_idx] = (key_states, value_states)
        seen["read"][layer_idx] = keys[:, :, : len(valid)]
        seen["values"][layer_idx] = values[:, :, : len(valid)]
        seen["reads"][layer_idx] = valid
        return keys, values

    def update_state(recurrent_states, layer_idx, *args, **kwargs):
        seen["state"][layer_idx] = out = inner_state(recurrent_states, layer_idx, *args, **kwargs)
        return out

    hf_cache.update = update
    if inner_state is not None:
        hf_cache.update_recurrent_state = update_state
    try:
        yield seen
    finally:
        del hf_cache.update
        if inner_state is not None:
            del hf_cache.update_recurrent_state


def feed_tracer(tracer, seen: dict, attentions, logits: torch.Tensor) -> None:
    """Call ``tracer.hook`` at the points kvexplore's model has, in layer order, from what the pass saw."""
    layers = sorted(set(seen["new"]) | set(seen["state"]))
    for i in layers:
        name = f"layers.{i}.attn"
        if i in seen["new"]:
            k, v = seen["new"][i]
            tracer.hook(f"{name}.k_new", k)
            tracer.hook(f"{name}.v_new", v)
            tracer.hook(f"{name}.cache_read", seen["read"][i])
            if attentions is not None and i < len(attentions) and attentions[i] is not None:
                tracer.hook(f"{name}.probs", attentions[i][..., : len(seen["reads"][i])].float())
        if i in seen["state"]:
            tracer.hook(f"{name}.state", seen["state"][i])
    tracer.hook("logits", logits)
