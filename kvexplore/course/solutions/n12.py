"""Notebook 12 (speculative decoding): the bytes a verification pass writes, and what the take-back leaves."""

from __future__ import annotations

from ..exercise import Exercise

from ...speculation.drafters import Draft, Drafter
from ..tiny import tiny

HELD, K = 20, 4  # positions in the cache before the verification; drafted tokens


def _written() -> int:
    """The bytes a verification pass (the newest token and K drafts) writes into a pre-allocated cache."""
    import torch

    from ...caches.factory import make_cache

    model = tiny()
    cache = make_cache("preallocated", model, max_seq_len=64)
    with torch.no_grad():
        model(torch.tensor([list(range(5, 5 + HELD))]), cache, 0)
        model(torch.tensor([[7, 8, 9, 10, 11][: K + 1]]), cache, HELD, keep_undo=True)
    return cache.inspect.memory_report().written_bytes


class OneRight(Drafter):
    """Drafts the target's own continuation once, when the sequence is ``at`` tokens long: the first right, the rest
    wrong (the reference token + 1)."""

    name = "one-right"

    def __init__(self, ref: list[int], at: int) -> None:
        self.ref, self.at = ref, at

    def propose(self, tokens, k, sampling, rng):
        if len(tokens) != self.at:
            return Draft([])
        nxt = self.ref[len(tokens):len(tokens) + k]
        return Draft([t if i == 0 else (t + 1) % 4096 for i, t in enumerate(nxt)])


def _after_take_back() -> int:
    """The cache's length after one verification of K drafts of which the target accepts the first."""
    from ...caches.factory import make_cache
    from ...runtime.generator import Generator

    model = tiny()
    prompt = list(range(5, 5 + HELD))
    plain = Generator(model, make_cache("preallocated", model, max_seq_len=64))
    plain.prefill(prompt)
    plain.run(K + 2, stop_at_eos=False)
    gen = Generator(model, make_cache("preallocated", model, max_seq_len=64), draft=OneRight(plain.tokens, HELD + 1),
                    draft_tokens=K)
    gen.prefill(prompt)      # the cache holds HELD positions; the token it chose is the newest, not yet in it
    gen.step()               # one verification
    (v,) = gen.speculation.verifications
    assert v.accepted == 1 and v.pos == HELD, v
    return gen.cache.length


def _position() -> int:
    from ...caches.memory import kv_bytes
    return kv_bytes(tiny().config, 1)


EXERCISES = [
    Exercise("12.1", "number", "The tiny model's pre-allocated cache (float32) holds 20 positions. A verification "
                               "pass feeds the newest token and 4 drafted tokens. How many bytes does the pass write "
                               "into the cache?", unit="bytes"),
    Exercise("12.2", "number", "In that verification the target accepts the first draft and rejects the second. How "
                               "many positions does the cache hold after the take-back?", unit="positions"),
]
ANSWERS = {"12.1": _written, "12.2": _after_take_back}
MISTAKES = {
    "12.1": [
        (lambda: K * _position(), "the pass feeds the newest token too (it is not in the cache yet): k + 1 positions."),
        (lambda: (K + 1) * _position() // tiny().config.num_layers, "every layer writes its own keys and values: "
                                                                      "count every layer."),
        (lambda: (K + 1) * _position() // 2, "a layer writes the values as well as the keys."),
        (lambda: (HELD + K + 1) * _position(), "only the fed positions are written: the cache's earlier positions "
                                               "stay where they are, nothing is copied."),
    ],
    "12.2": [
        (lambda: HELD + K + 1, "the take-back removes the rejected positions: the cache must hold what a cache that "
                               "never saw the rejected drafts holds."),
        (lambda: HELD + 3, "the target's own token after the accepted draft is not in the cache yet: the next pass "
                           "feeds it, like any newest token."),
        (lambda: HELD + 1, "an accepted draft stays in the cache: it is a token of the sequence now."),
        (lambda: HELD, "the fed newest token was written by the pass and is part of the sequence: it stays."),
    ],
}
HINTS = {
    "12.1": "the pass writes k + 1 positions (the newest token and the k drafts), every layer, keys and values: k + 1 "
            "times the bytes of one position (kvexplore.kv_bytes(config, 1)). The memory report's written_bytes "
            "checks it.",
    "12.2": "the cache keeps the positions it held, the fed newest token and the accepted drafts; the rejected ones "
            "are taken back (cache.length after gen.step() says it).",
}
