"""A student's layer run through the doctor: their class serves every full layer of a pre-allocated cache of the tiny
model, and each cached step is compared with a recomputation without a cache. Wrong: the doctor's first step, layer
and position, and what a probe of the buffers says went wrong (a write one slot off, a read window too short or too
long, keys and values swapped). :data:`EXERCISE` declares it for the harness of every code exercise
(:mod:`kvexplore.course.code_check`)."""

from __future__ import annotations

import torch

from ..caches.layers.preallocated_layer import PreallocatedLayer
from ..caches.strategies.preallocated import PreallocatedCache
from .code_check import CodeExercise
from .tiny import tiny

PROMPT = [5, 17, 42, 9, 100, 33, 61, 7]  # token ids of the packaged tiny model
STEPS = 6


def cache_class(layer_cls: type) -> type:
    """A pre-allocated cache whose full layers are ``layer_cls`` (built as the pre-allocated layer is)."""

    class StudentCache(PreallocatedCache):
        kind = f"student:{layer_cls.__name__}"

        def full_layer(self, spec):
            return layer_cls(spec, self.batch_size, self.dtype, self.device, self._capacity)

    return StudentCache


def _watch(layer_cls: type):
    """``layer_cls`` recording what layer 0's writes returned, and the hint those windows give."""
    seen: list[tuple[int, int, int]] = []  # (pos, q_len, positions the returned keys cover), layer 0

    class Probe(layer_cls):
        def write(self, step, k, v):
            out = super().write(step, k, v)
            if self.spec.index == 0:
                seen.append((step.pos, k.shape[2], out[0].shape[2]))
            return out

    return Probe, lambda: _window_hint(seen)


def _probe(model, layer_cls) -> str:
    """Why, from the buffers: where each position's key landed in layer 0 ("" when every key is where it belongs:
    then the window :func:`_watch` saw says why)."""
    ids = torch.tensor([PROMPT[:5]])
    ref = PreallocatedCache(model.config, max_seq_len=16)
    mine = cache_class(layer_cls)(model.config, max_seq_len=16)
    try:
        with torch.no_grad():
            model(ids, ref, 0)
            model(ids, mine, 0)
    except Exception as e:
        return f"(your write raised {type(e).__name__} on a plain prefill: {e})"
    want, got = ref.layers[0], mine.layers[0]
    for p in range(5):
        key = want.k[0, :, p]
        if torch.allclose(got.k[0, :, p], key):
            continue
        if torch.allclose(got.v[0, :, p], key, atol=1e-6):
            return "Hint: the keys buffer holds the values: write k into the keys and v into the values."
        for s in range(16):
            if torch.allclose(got.k[0, :, s], key):
                off = s - p
                return (f"Hint: the key of position {p} landed in slot {s}: the write is {abs(off)} slot"
                        f"{'s' * (abs(off) != 1)} {'after' if off > 0 else 'before'} its position. A step's first new "
                        f"position is past_len (step.pos), and its q_len positions follow it.")
        return (f"Hint: no slot holds the model's key of position {p}: copy the step's k into the buffer "
                f"(narrow(2, past_len, q_len).copy_(k)), not something computed from it.")
    return ""


def _window_hint(seen: list[tuple[int, int, int]]) -> str:
    """What the returned windows got wrong, from the (pos, q_len, positions returned) layer 0's writes gave."""
    for pos, q, n in seen:
        if n < pos + q:
            return (f"Hint: a step writing {q} position{'s' * (q != 1)} at past_len {pos} returned keys of {n} "
                    f"position{'s' * (n != 1)}: attention must read every position so far, the new ones included "
                    f"(0 .. past_len + q_len - 1).")
        if n > pos + q:
            return (f"Hint: a step writing at past_len {pos} returned keys of {n} positions, past the {pos + q} "
                    f"written so far: the slots after them were never written for this sequence (zeros, or stale).")
    return ""


EXERCISE = CodeExercise(
    base=PreallocatedLayer, task="that writes its own write()", model=tiny,
    cache=lambda model, cls: cache_class(cls)(model.config, max_seq_len=64), prompt=PROMPT, steps=STEPS,
    probes=(_probe,), watch=_watch, probe_on_error=False,
    fallback="Hint: the slots hold the right keys; compare what your write returns with narrow(2, 0, past_len + "
             "q_len).")
