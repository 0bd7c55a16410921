"""Notebook 03 (why not disable the cache): the tokens every forward pass feeds without a cache."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

PROMPT, STEPS = 8, 24


def _fed(kind: str) -> int:
    """Tokens fed by every forward pass of a prefill and STEPS decode steps of the tiny model, through ``kind``."""
    from ...caches.factory import make_cache
    from ...runtime.generator import Generator

    model = tiny()
    gen = Generator(model, make_cache(kind, model, max_seq_len=PROMPT + STEPS + 8))
    records = [gen.prefill(list(range(5, 5 + PROMPT)))] + gen.run(STEPS, stop_at_eos=False)
    return sum(r.input_len for r in records)


EXERCISES = [
    Exercise("03.1", "number", "The tiny model runs without a cache (NoCache): a prefill of an 8-token prompt, then 24 "
                               "decode steps. How many tokens do all those forward passes feed in total?",
             unit="tokens"),
]
ANSWERS = {"03.1": lambda: _fed("none")}
MISTAKES = {"03.1": [
    (lambda: _fed("preallocated"), "that is what a cache feeds: every token once. Without a cache nothing is kept, "
                                   "so every pass feeds the whole sequence so far."),
    (lambda: sum(range(PROMPT + 1, PROMPT + STEPS + 1)), "the prefill is a forward pass too: it feeds the prompt's "
                                                         "tokens."),
    (lambda: (STEPS + 1) * (PROMPT + STEPS), "the sequence grows by one token a step: each pass feeds the sequence "
                                             "as it is then, not as long as it ends."),
    (lambda: sum(range(PROMPT, PROMPT + STEPS + 2)), "the last token generated is never fed: the last pass feeds "
                                                     "the sequence before it."),
]}
HINTS = {"03.1": "the prefill feeds the prompt; each decode step without a cache feeds the whole sequence so far, "
                 "one token longer than the step before (record.input_len says it per step). Add them up."}
