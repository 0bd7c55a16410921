"""Notebook 04 (memory: pre-allocated against concatenating): what a concatenating cache copies and allocates."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

PROMPT, STEPS = 8, 10


def _records(kind: str = "concat"):
    """The memory reports of STEPS decode steps of the tiny model after an 8-token prompt, through ``kind``."""
    from ...caches.factory import make_cache
    from ...runtime.generator import Generator

    model = tiny()
    gen = Generator(model, make_cache(kind, model, max_seq_len=64))
    gen.prefill(list(range(5, 5 + PROMPT)))
    return [r.memory for r in gen.run(STEPS, stop_at_eos=False)]


def _position() -> int:
    """Bytes of one position of the tiny model's cache (every layer, keys and values, float32)."""
    from ...caches.memory import kv_bytes
    return kv_bytes(tiny().config, 1)


def _layers() -> int:
    return tiny().config.num_layers


EXERCISES = [
    Exercise("04.1", "number", "A concatenating cache of the tiny model (float32) holds an 8-token prompt; then 10 "
                               "decode steps run. How many bytes do those 10 steps copy in all?", unit="bytes"),
    Exercise("04.2", "number", "In the same 10 decode steps, how many tensors does the concatenating cache allocate?",
             unit="allocations"),
]
ANSWERS = {
    "04.1": lambda: sum(m.copied_bytes for m in _records()),
    "04.2": lambda: sum(m.allocations for m in _records()),
}
MISTAKES = {
    "04.1": [
        (lambda: sum(m.copied_bytes for m in _records("preallocated")), "that is the pre-allocated cache, which "
                                                                         "writes in place; torch.cat copies."),
        (lambda: STEPS * _position(), "those are the bytes the steps write (one new position each); torch.cat also "
                                      "copies the whole cache as it was before the step."),
        (lambda: sum(range(PROMPT + 1, PROMPT + STEPS + 1)) * _position(),
         "the copy is the cache as it was before the step: the new position is written, not copied."),
        (lambda: sum(range(PROMPT, PROMPT + STEPS)) * _position() // _layers(),
         "every layer has its own keys and values, and each is copied: count every layer."),
    ],
    "04.2": [
        (lambda: STEPS, "not one allocation a step: every layer's keys and every layer's values are a tensor of "
                        "their own, each concatenated anew."),
        (lambda: 2 * STEPS, "every layer has its own keys and values: count them in every layer."),
        (lambda: _layers() * STEPS, "keys and values are two tensors per layer, each one concatenated anew."),
        (lambda: sum(m.allocations for m in _records("preallocated")), "that is the pre-allocated cache, which "
                                                                        "allocates nothing while it decodes."),
    ],
}
HINTS = {
    "04.1": "at each step torch.cat copies the whole cache as it was before it: the positions held so far x the bytes "
            "of one position (kvexplore.kv_bytes(config, 1)). Add the steps up (record.memory.copied_bytes says it "
            "per step).",
    "04.2": "count the tensors a step replaces: torch.cat returns a new tensor for each layer's keys and each layer's "
            "values (record.memory.allocations says it per step).",
}
