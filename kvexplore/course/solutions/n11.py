"""Notebook 11 (the eviction lab): what a press keeps per head, and the bytes its compact storage holds."""

from __future__ import annotations

from ..exercise import Exercise, Moment
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


# 11.3, predict then see: the sawtooth of a press while decoding
def _pressing_explorer():
    from ...explorer.widget import Explorer

    ex = Explorer("tiny", strategies=("evict",), max_seq_len=64, prompt="Call me Ishmael. Some years ago",
                  strategy_options={"evict": {"press": "knorm", "kept_tokens": 8, "decode_every": 4}})
    ex.run(3)
    return ex


def _held(ex) -> int:
    (n,) = set(ex.lanes["evict"].cache.eviction.held_counts(0))  # a uniform budget: every head holds as many
    return n


def _next_held(ex) -> int:
    """Worked out at the moment: one more position, unless the Step completes decode_every tokens since the last
    press, which then cuts every head back to decode_target (what the prompt's press kept)."""
    cache = ex.lanes["evict"].cache
    since = cache.length - cache.eviction.press_events[-1].length
    return 8 if since + 1 == 4 else _held(ex) + 1


EXERCISES.append(Exercise("11.3", "predict", "The explorer's evict lane pressed its prompt down to 8 positions per "
                                             "head (kept_tokens=8) and presses again every 4 decoded tokens "
                                             "(decode_every=4) down to 8. It has decoded 3 tokens since. After the "
                                             "next Step, how many positions does each head hold?", unit="positions"))
MOMENTS = {"11.3": Moment(_pressing_explorer, _held, _next_held,
                          "the eviction view: positions held over the steps")}
MISTAKES["11.3"] = [
    (lambda ex: 12, "the press runs every 4 decoded tokens: count the tokens since the last press."),
    (lambda ex: 9, "the press runs after the Step writes its token: the new position is scored with the others, and "
                   "8 are kept in all."),
]
HINTS["11.3"] = "follow the sawtooth in the eviction view: one more position a Step until the press cuts it back."
