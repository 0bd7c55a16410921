"""Notebook 07 (debugging cache bugs): where the doctor first finds a planted off-by-one write."""

from __future__ import annotations

from ..exercise import Exercise

from ...caches.strategies.preallocated import PreallocatedCache
from ..tiny import tiny

PROMPT = 10


class OffByOneWrite(PreallocatedCache):
    """Notebook 07's bug 1: a decode step writes its key and value one slot past its position; the prefill is right."""

    def write(self, layer, pos, k, v):
        q_len = k.shape[2]
        at = pos + 1 if q_len == 1 else pos
        self._k[layer].narrow(2, at, q_len).copy_(k)
        self._v[layer].narrow(2, at, q_len).copy_(v)
        return self._k[layer].narrow(2, 0, pos + q_len), self._v[layer].narrow(2, 0, pos + q_len)


def _first_position() -> int:
    from ...diagnosis.run import doctor

    model = tiny()
    report = doctor(model, prompt=list(range(5, 5 + PROMPT)), steps=4,
                    cache=OffByOneWrite(model.config, max_seq_len=32))
    return report.position


EXERCISES = [
    Exercise("07.1", "number", "Run the off-by-one write (bug 1: a decode step writes one slot past its position) "
                               "through kvexplore.doctor on the tiny model with a 10-token prompt. At which position "
                               "does the cache first part from the recomputation?"),
]
ANSWERS = {"07.1": _first_position}
MISTAKES = {"07.1": [
    (lambda: 0, "the prompt goes through the prefill path, which writes where it should: the prefill agrees."),
    (lambda: PROMPT - 1, "the last prompt position is written by the prefill too, which is right: look at the first "
                         "position a decode step writes."),
    (lambda: PROMPT + 1, "that is the slot the buggy write fills; the doctor names the position whose step reads "
                         "wrong: the token it was given."),
]}
HINTS = {"07.1": "the prefill path is right and the decode path is not: find the position the first decode step "
                 "computes (positions count from 0)."}
