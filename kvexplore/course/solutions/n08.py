"""Notebook 08 (caches of today's models, layer by layer): the ring of a sliding-window layer, and the bytes a real
hybrid's cache holds."""

from __future__ import annotations

import functools

import torch

from ..code_check import CodeExercise, RingLayerExercise, ring_cache
from ..exercise import Exercise
from ..tiny import tiny

WINDOW = 4
PROMPT = [5, 17, 42, 9, 100, 33, 61, 7]  # longer than the window: the prefill already wraps the ring
GEMMA_TOKENS = 6000  # 08.2: one sequence of Gemma 3 1B, in bfloat16


def _gemma3_1b(full_every: int | None = None, **changes):
    """Gemma 3 1B's config as notebook 08's section 1 builds it (google/gemma-3-1b-pt/config.json): every 6th layer
    full (transformers' rule, (i + 1) % 6 == 0), the others sliding over 512 positions. ``full_every``: a wrong rule,
    i % 6 == 0."""
    import dataclasses

    from ...config.model_config import ModelConfig

    n = 26
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    if full_every is not None:
        types = ["full_attention" if i % full_every == 0 else "sliding_attention" for i in range(n)]
    config = ModelConfig(architecture="Gemma3ForCausalLM", hidden_size=1152, intermediate_size=6912, num_layers=n,
                         num_heads=4, num_kv_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
                         sliding_window=512, layer_types=types)
    return dataclasses.replace(config, **changes) if changes else config


def _gemma_bytes(config=None, dtype=None) -> int:
    from ...caches.memory import kv_bytes

    return kv_bytes(_gemma3_1b() if config is None else config, GEMMA_TOKENS, 1, dtype or torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _hybrid():
    """A Gemma 3 style model with random weights (fixed seed): layers 0-2 slide a window of 4, layer 3 is full."""
    import dataclasses

    from ...models.model import Model

    config = dataclasses.replace(tiny().config, architecture="Gemma3ForCausalLM", num_layers=4, hidden_size=64,
                                 intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=True,
                                 norm_style="gemma", sandwich_norms=True, embed_scale=True,
                                 hidden_act="gelu_pytorch_tanh", sliding_window=WINDOW,
                                 layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                 rope_by_type={"sliding_attention": {"rope_theta": 10000.0}})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Model(config).eval()


def _cache(model, cls):
    from ...caches.strategies.preallocated import PreallocatedCache
    return ring_cache(PreallocatedCache, cls)(model.config, max_seq_len=64)


def _ring(model, cls) -> RingLayerExercise:
    return next(layer for layer in _cache(model, cls).layers if isinstance(layer, cls))


def _slots_in_range(model, cls) -> str:
    ring = _ring(model, cls)
    for p in range(3 * WINDOW):
        s = ring.slot(p)
        if not 0 <= s < WINDOW:
            return (f"Hint: position {p} goes to slot {s}, but the ring has {WINDOW} slots (0..{WINDOW - 1}): past the "
                    f"window a ring wraps round, and a new position overwrites the oldest one (writing past the ring).")
    return ""


def _written_where_read(model, cls) -> str:
    ring = _ring(model, cls)
    for p in range(3 * WINDOW):
        s, want = ring.slot(p), p % WINDOW
        if s != want:
            off = (s - want) % WINDOW
            off = off if off <= WINDOW // 2 else off - WINDOW
            return (f"Hint: position {p} is written to slot {s}, {abs(off)} slot{'s' * (abs(off) != 1)} "
                    f"{'after' if off > 0 else 'before'} the slot a reader finds it in once the ring wraps (an "
                    f"off-by-one in the slot): position 0 is in slot 0, and position p shares its slot with p - "
                    f"window.")
    return ""


def _reads_what_it_should(model, cls) -> str:
    ring = _ring(model, cls)
    for q in range(3 * WINDOW):
        for pos in (q, max(0, q - 2)):
            got = list(ring.reads(q, pos))
            first = max(0, q - WINDOW + 1)
            if len(got) > pos - first and len(got) > pos:
                return (f"Hint: a query at position {q} (the step starting at {pos}) reads {len(got)} slot"
                        f"{'s' * (len(got) != 1)} from the ring, but only {pos} position{'s' * (pos != 1)} "
                        f"{'was' if pos == 1 else 'were'} written before it: before the ring is full the other slots "
                        f"are stale (never written for this sequence); read only positions that exist.")
            if len(got) > pos - first:
                return (f"Hint: a query at position {q} (the step starting at {pos}) reads {len(got)} slots from the "
                        f"ring, but its window of {WINDOW} holds only {pos - first} position"
                        f"{'s' * (pos - first != 1)} before {pos}: it reads itself and the {WINDOW - 1} positions "
                        f"before it, no more (an off-by-one in the window).")
            if sorted(got) != sorted(p % WINDOW for p in range(first, pos)):
                return (f"Hint: a query at position {q} (the step starting at {pos}) should read the ring slots of "
                        f"positions {first}..{pos - 1} (where they were written); yours reads slots {got}.")
    return ""


EXERCISES = [
    Exercise("08.1", "layer", "Write a sliding layer's ring: slot(p), the slot of a ring of `window` slots that "
                              "position p is written to, and reads(q, pos), the slots a query at q reads from the "
                              "ring in a step starting at pos."),
    Exercise("08.2", "number", "How many bytes does Gemma 3 1B's cache (section 1's config: 26 layers, "
                               "gemma_types(26, 6), sliding_window=512, 1 KV head of 256) hold for one sequence of "
                               "6,000 tokens in bfloat16?", unit="bytes"),
]
ANSWERS = {"08.2": _gemma_bytes}
MISTAKES = {"08.2": [
    (lambda: _gemma_bytes(_gemma3_1b(layer_types=["full_attention"] * 26, sliding_window=None)),
     "a sliding layer keeps a ring of its window, not every position: past 512 tokens it stops growing."),
    (lambda: _gemma_bytes(_gemma3_1b(full_every=6)), "transformers' rule makes layer i full when (i + 1) % 6 == 0: "
                                                     "the first layer slides, and 26 layers have 4 full ones."),
    (lambda: _gemma_bytes(dtype=torch.float32), "bfloat16 takes 2 bytes a value, not 4."),
    (lambda: _gemma_bytes(_gemma3_1b(layer_types=["full_attention"] * 4, num_layers=4)),
     "the sliding layers hold keys and values too: their window of positions each."),
    (lambda: _gemma_bytes(_gemma3_1b(num_kv_heads=4)), "count the KV heads (num_kv_heads=1), not the query heads."),
]}
HINTS = {"08.2": "per layer, 2 (K and V) x kv_heads x head_dim x 2 bytes a position; a full layer holds all 6,000 "
                 "positions, a sliding one at most its window (kvexplore.kv_bytes does the sum, or section 1's "
                 "by_hand)."}
CODE = {"08.1": CodeExercise(
    base=RingLayerExercise, task="that writes slot(p) and reads(q, pos)", model=_hybrid, cache=_cache,
    prompt=PROMPT, steps=6, model_name="a Gemma 3 style model with a window of 4",
    probes=(_slots_in_range, _reads_what_it_should, _written_where_read),
    fallback="Hint: a query at q reads positions q - window + 1 .. q; those before the step are in the ring.")}


class Reference(RingLayerExercise):
    def slot(self, p):
        return p % self.window                      # position p overwrites p - window

    def reads(self, q, pos):
        first = max(0, q - self.window + 1)         # the window, not before position 0
        return [p % self.window for p in range(first, pos)]


class NoWrap(Reference):
    def slot(self, p):
        return p


class OneSlotLate(Reference):
    def slot(self, p):
        return (p + 1) % self.window


class ReadsStaleSlots(Reference):
    def reads(self, q, pos):
        return [p % self.window for p in range(q - self.window + 1, pos)]


class ReadsOneTooMany(Reference):
    def reads(self, q, pos):
        return [p % self.window for p in range(max(0, q - self.window), pos)]


REFERENCE = {"08.1": Reference}
WRONG = {"08.1": [(NoWrap, "writing past the ring"),
                  (OneSlotLate, "an off-by-one in the slot"),
                  (ReadsStaleSlots, "before the ring is full the other slots are stale"),
                  (ReadsOneTooMany, "an off-by-one in the window")]}
