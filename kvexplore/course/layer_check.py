"""A student's layer run through the doctor: their class serves every full layer of a pre-allocated cache of the tiny
model, and each cached step is compared with a recomputation without a cache. Wrong: the doctor's first step, layer
and position, and what a probe of the buffers says went wrong (a write one slot off, a read window too short or too
long, keys and values swapped)."""

from __future__ import annotations

import torch

from ..caches.layers.preallocated_layer import PreallocatedLayer
from ..caches.strategies.preallocated import PreallocatedCache
from ..errors import SettingsError
from .verdict import Verdict

PROMPT = [5, 17, 42, 9, 100, 33, 61, 7]  # token ids of the packaged tiny model
STEPS = 6


def _tiny():
    from ..formats.loading import load
    return load("tiny")


def cache_class(layer_cls: type) -> type:
    """A pre-allocated cache whose full layers are ``layer_cls`` (built as the pre-allocated layer is)."""

    class StudentCache(PreallocatedCache):
        kind = f"student:{layer_cls.__name__}"

        def full_layer(self, spec):
            return layer_cls(spec, self.batch_size, self.dtype, self.device, self._capacity)

    return StudentCache


def check_layer(exercise: str, layer_cls) -> Verdict:
    if not (isinstance(layer_cls, type) and issubclass(layer_cls, PreallocatedLayer)):
        raise SettingsError(f"{exercise} takes your layer class, a subclass of PreallocatedLayer (from "
                            f"kvexplore.caches.layers.preallocated_layer import PreallocatedLayer) that writes its own "
                            f"write(); got {layer_cls!r}")
    from ..diagnosis.run import doctor

    model = _tiny()
    seen: list[tuple[int, int, int]] = []  # (pos, q_len, positions the returned keys cover), layer 0

    class Probe(layer_cls):
        def write(self, step, k, v):
            out = super().write(step, k, v)
            if self.spec.index == 0:
                seen.append((step.pos, k.shape[2], out[0].shape[2]))
            return out

    try:
        report = doctor(model, prompt=PROMPT, steps=STEPS, cache=cache_class(Probe)(model.config, max_seq_len=64))
    except SettingsError:
        raise
    except Exception as e:  # the student's code (or attention over what it returned) raised: say what, and why
        window = _window_hint(seen)
        return Verdict(exercise, False, f"running the tiny model with your layer raised {type(e).__name__}: {e}."
                                        + (f" {window}" if window else ""))
    if not report.diverged:
        return Verdict(exercise, True, f"your layer gives what a recomputation without a cache gives, at every one "
                                       f"of {report.steps} steps and every layer of the tiny model")
    verb = "differ" if report.what.endswith("s") else "differs"
    where = (f"at step {report.step} (position {report.position}), layer {report.layer}: the {report.what} "
             f"{verb} from a recomputation without a cache (by up to {report.max_diff:.3g})")
    return Verdict(exercise, False, f"{where}. {_probe(model, layer_cls, seen)}")


def _probe(model, layer_cls, seen: list[tuple[int, int, int]]) -> str:
    """Why, from the buffers: where each position's key landed in layer 0, and how far the returned window reached."""
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
    return _window_hint(seen) or ("Hint: the slots hold the right keys; compare what your write returns with "
                                  "narrow(2, 0, past_len + q_len).")


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
