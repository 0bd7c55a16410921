"""Notebook 15 (a zoo of cache bugs): the slot a length counted too early writes, a prefix hit that should not be,
and where a ring evicting too soon first shows."""

from __future__ import annotations

from ..exercise import Exercise
from ..tiny import tiny

PROMPT, BLOCK = 10, 8
SHORT_PROMPT = 5  # 15.3: a prompt shorter than the planted ring


def _late_slot() -> int:
    """The slot layer 1 of the planted "length-counted-early" cache writes the first decode step's key into."""
    import torch

    from ...bugs.decoding import LateCache
    from ...caches.strategies.preallocated import PreallocatedCache

    model = tiny()
    late, fixed = LateCache(model.config, max_seq_len=32), PreallocatedCache(model.config, max_seq_len=32)
    with torch.no_grad():
        for cache in (late, fixed):
            model(torch.tensor([list(range(5, 5 + PROMPT))]), cache, 0)
            model(torch.tensor([[77]]), cache, PROMPT)
    key = fixed.key(1)[0, :, PROMPT]  # layer 1's key of the step's token (layer 0 below it is right in both)
    (slot,) = [s for s in range(32) if torch.allclose(late.key(1)[0, :, s], key)]
    return slot


def _hit(planted: bool = True) -> int:
    """Request 1's tokens from the cache when block hashes forget their parent (the planted "hash-forgets-prefix")."""
    from ...bugs.prefix import TokensOnlyPool
    from ...prefix.pool import PrefixPool

    pool = (TokensOnlyPool if planted else PrefixPool)(tiny(), num_blocks=32, block_size=BLOCK)
    first = list(range(5, 5 + 27))
    second = first[BLOCK:] + [200, 201]  # starts with the first's second block: 21 tokens
    pool.serve(first, response=[5])
    return pool.serve(second, response=[5]).hit_tokens


def _early_report():
    """The doctor's report on the planted "window-evicts-early" rings (sliding layers of the tiny-windowed model, 4
    slots short of their window), with a SHORT_PROMPT-token prompt."""
    from ...bugs.models import zoo_model
    from ...bugs.windows import ShortRings
    from ...diagnosis.run import doctor

    model = zoo_model("tiny-windowed")
    return doctor(model, prompt=list(range(5, 5 + SHORT_PROMPT)), steps=SHORT_PROMPT + 4,
                  cache=ShortRings(model.config, max_seq_len=32))


def _window() -> int:
    from ...bugs.models import WINDOW
    return WINDOW


def _ring() -> int:
    """The planted ring's slots: the window less the positions it evicts too soon."""
    from ...bugs.windows import EARLY
    return _window() - EARLY


EXERCISES = [
    Exercise("15.1", "number", "The \"length-counted-early\" bug: the tiny model's cache holds a 10-token prompt and "
                               "the first decode step runs. Into which slot does layer 1 write the new token's key?"),
    Exercise("15.2", "number", "The \"hash-forgets-prefix\" bug (a block hashed by its own tokens only), blocks of 8: "
                               "request 0 is 27 tokens; request 1 is request 0's tokens 8 to 26 and two new ones. How "
                               "many of request 1's tokens does the planted pool take from the cache?", unit="tokens"),
    Exercise("15.3", "number", "The \"window-evicts-early\" bug (section 3: the tiny-windowed model's sliding layers "
                               "slide over 12 positions, the planted rings hold 4 slots fewer). kvexplore.doctor runs "
                               "it with a 5-token prompt and 9 steps: at which position does the cache first part "
                               "from the recomputation (report.position)?"),
]
ANSWERS = {"15.1": _late_slot, "15.2": _hit, "15.3": lambda: _early_report().position}
MISTAKES = {
    "15.1": [
        (lambda: PROMPT, "that is the slot a correct layer writes (the step's position): this one counts the length "
                         "as already moved by layer 0."),
        (lambda: PROMPT - 1, "positions count from 0: the prompt fills slots 0 to 9, and the step's token is the next "
                             "position."),
        (lambda: 1, "the question is the slot in layer 1's storage, not the layer: a slot is a position in the "
                    "sequence."),
    ],
    "15.2": [
        (lambda: _hit(planted=False), "that is the fixed pool: a block's hash names the tokens before it, so nothing "
                                      "matches. The planted hash forgets them."),
        (lambda: BLOCK, "request 1's second block is also a block of request 0 (its third): both match."),
        (lambda: 27 - BLOCK, "only whole blocks are shared: a block is matched by its hash, all 8 tokens."),
    ],
    "15.3": [
        (_window, "that is where the fixed ring would first drop a position; the planted ring is 4 slots shorter, "
                  "and departs as soon as the sequence outgrows it."),
        (lambda: _ring() - 1, "the query at that position reads itself and every position before it, all still "
                                    "in the ring: nothing is lost until a write overwrites a slot."),
        (lambda: _ring() + 1, "positions count from 0: the ring's slots fill with positions 0 onwards, and the "
                                    "first write past its size overwrites position 0, at that very step."),
        (lambda: SHORT_PROMPT, "that is the first decode step; while the sequence is shorter than the ring, both "
                               "rings hold every position and agree."),
        (lambda: _early_report().step, "that is the doctor's step (report.step, counted from the prompt's "
                                        "pass); the question asks the position (report.position)."),
    ],
}
HINTS = {
    "15.1": "the bug moves the length when layer 0 writes, before the layers above it run: where does a layer above "
            "0 then think the step's position is?",
    "15.2": "cut both requests into blocks of 8 and hash each block by its own tokens alone: which of request 1's "
            "whole blocks are also a block of request 0?",
    "15.3": "a ring of n slots holds positions 0 to n - 1; find the first position whose write overwrites one the "
            "window of 12 still reads.",
}
