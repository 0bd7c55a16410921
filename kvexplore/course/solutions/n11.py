"""Notebook 11 (the eviction lab): what a press keeps per head, and the bytes its compact storage holds."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

CONTEXT, RATIO, SLOTS = 90, 0.75, 128


def _cache(storage: str = "compact"):
    """A KNorm press at compression_ratio 0.75 on a 90-token prompt of the tiny model."""
    import torch

    from ...caches.factory import make_cache

    model = tiny()
    cache = make_cache("evict", model, max_seq_len=SLOTS, press="knorm", compression_ratio=RATIO, storage=storage)
    with torch.no_grad():
        model(torch.tensor([list(range(5, 5 + CONTEXT))]), cache, 0, last_only=True)
    return cache


def _kept() -> int:
    (n,) = {len(h) for h in _cache().eviction.kept_positions(0)}  # every head keeps the same number
    return n


def _position() -> int:
    from ...caches.memory import kv_bytes
    return kv_bytes(tiny().config, 1)


EXERCISES = [
    Exercise("11.1", "number", "A KNorm press with compression_ratio=0.75 compresses a 90-token prompt of the tiny "
                               "model. How many positions does each KV head keep?", unit="positions"),
    Exercise("11.2", "number", "With the default compact storage, how many bytes does that cache hold after the press "
                               "(every layer, keys and values, float32)?", unit="bytes"),
]
ANSWERS = {
    "11.1": _kept,
    "11.2": lambda: _cache().inspect.reserved_bytes,
}
MISTAKES = {
    "11.1": [
        (lambda: CONTEXT - _kept(), "that is how many the press evicts: compression_ratio is the share thrown away."),
        (lambda: _kept() + 1, "the budget rounds down: int(n x (1 - compression_ratio))."),
        (lambda: CONTEXT, "the press runs right after the prompt: the prompt's positions are not all kept."),
        (lambda: 2 * _kept(), "the budget is per KV head: count one head's positions, not the layer's."),
    ],
    "11.2": [
        (lambda: _kept() * _position(), "the compact storage keeps free slots for the next tokens (its headroom, 64 "
                                        "by default) on top of the kept positions."),
        (lambda: _cache("mask").inspect.reserved_bytes, "that is the mask storage, which gives nothing back; the "
                                                        "compact storage shrinks."),
        (lambda: _cache().inspect.reserved_bytes // _cache().config.num_layers,
         "every layer holds its own kept keys and values: count every layer."),
        (lambda: (CONTEXT - _kept() + _cache().headroom) * _position(),
         "count the positions kept, not the ones evicted."),
    ],
}
HINTS = {
    "11.1": "the budget per head is int(n x (1 - compression_ratio)) of its n positions.",
    "11.2": "(positions kept + the storage's headroom slots) x the bytes of one position "
            "(kvexplore.kv_bytes(config, 1)); cache.inspect.reserved_bytes checks it.",
}
