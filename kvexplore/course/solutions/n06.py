"""Notebook 06 (compressing the cache): what a sink cache (attention sinks and a window) still holds."""

from __future__ import annotations

from ..exercise import Exercise, Moment
from ..tiny import tiny

SINKS, WINDOW, PROMPT, STEPS = 4, 28, 57, 8
LENGTH = PROMPT + STEPS  # positions written: the prompt, then one a decode step


def _held() -> list[int]:
    """The positions layer 0 of a sink cache holds after a 57-token prompt and 8 decode steps of the tiny model."""
    from ...caches.factory import make_cache
    from ...runtime.generator import Generator

    model = tiny()
    cache = make_cache("sink", model, sinks=SINKS, window=WINDOW)
    gen = Generator(model, cache)
    gen.prefill(list(range(5, 5 + PROMPT)))
    gen.run(STEPS, stop_at_eos=False)
    return sorted(p for p in cache.inspect.slot_view(0).positions if p >= 0)


EXERCISES = [
    Exercise("06.1", "number", "A sink cache of the tiny model (sinks=4, window=28) takes a 57-token prompt, then 8 "
                               "decode steps, each writing one position (positions 0 to 64). How many positions does "
                               "each layer hold?", unit="positions"),
    Exercise("06.2", "number", "In the same cache, which is the oldest position it still holds after the sinks (the "
                               "first position of its window)?"),
]
ANSWERS = {
    "06.1": lambda: len(_held()),
    "06.2": lambda: _held()[SINKS],
}
MISTAKES = {
    "06.1": [
        (lambda: LENGTH, "a sink cache does not keep every position: past its slots it forgets the middle."),
        (lambda: WINDOW, "the sinks are kept on top of the window: count both."),
        (lambda: WINDOW - SINKS, "the sinks do not come out of the window: they are slots of their own."),
    ],
    "06.2": [
        (lambda: SINKS, "the sequence is longer than the cache's slots: the positions after the sinks have been "
                        "evicted, all but the most recent."),
        (lambda: LENGTH - SINKS - WINDOW, f"the window is the last {WINDOW} positions only: the sinks are not part "
                                          f"of it."),
        (lambda: LENGTH - WINDOW - 1, "one off: the window's positions end with the newest one written, and "
                                      "include it."),
    ],
}
HINTS = {
    "06.1": "a sink cache keeps the first `sinks` positions and the most recent `window` ones, whatever the length "
            "(cache.inspect.slot_view(0).positions lists them).",
    "06.2": "the window holds the most recent `window` positions: count back from the newest position written.",
}


# 06.3, predict then see: the position a sink cache evicts at the next Step
def _sink_explorer():
    from ...explorer.widget import Explorer

    ex = Explorer("tiny", strategies=("sink",), max_seq_len=64, prompt="Call me Ishmael. Some years ago",
                  strategy_options={"sink": {"sinks": 4, "window": 12}})
    ex.run(10)
    return ex


def _evicted(ex) -> int:
    (position,) = ex.lanes["sink"].cache.evicted_last_step
    return position


EXERCISES.append(Exercise("06.3", "predict", "The explorer's sink cache (sinks=4, window=12) is full and evicts one "
                                             "position a Step. Which position will the next Step evict?"))
MOMENTS = {"06.3": Moment(_sink_explorer, _evicted, lambda ex: ex.lanes["sink"].cache.length - 12,
                          "the cache map: the slot marked evicted")}
MISTAKES["06.3"] = [
    (lambda ex: 0, "the first 4 positions are the attention sinks: they are never evicted."),
    (lambda ex: _evicted(ex) - 1, "that one left the window at the Step before: the window holds the newest 12 "
                                  "positions, the new one included."),
    (lambda ex: 4, "positions after the sinks have been leaving one a Step since the cache filled: the oldest still "
                   "in the window leaves now."),
    (lambda ex: _evicted(ex) + 1, "one off: the window's 12 positions include the one the Step writes."),
]
HINTS["06.3"] = "the window holds the newest 12 positions, the one the Step writes included: which falls out?"
