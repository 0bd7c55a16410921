"""Notebook 07 (debugging cache bugs): where the doctor first finds a planted off-by-one write, and how far the stale
reads of a rewound cache reach."""

from __future__ import annotations

from ..exercise import Exercise

from ...caches.strategies.preallocated import PreallocatedCache
from ..tiny import tiny

PROMPT = 10
EARLIER, CHECKED = 24, 30  # 07.2: the sequence the cache held before its rewind, and the positions checked


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


class ReadsStaleSlots(PreallocatedCache):
    """Notebook 07's bug 3: reads up to the highest slot ever written, not the current length."""

    def write(self, layer, pos, k, v):
        super().write(layer, pos, k, v)
        n = max(pos + k.shape[2], self._high_water)
        return self._k[layer].narrow(2, 0, n), self._v[layer].narrow(2, 0, n)


def _wrong_positions() -> list[int]:
    """The positions whose logits part (by more than 1e-3) from a recomputation without a cache, when bug 3's cache
    held an EARLIER-token sequence, was rewound to 0 and a PROMPT-token prompt is teacher-forced through it, one token a
    step, up to position CHECKED - 1 (notebook 07's check_cache)."""
    import torch

    from ...caches.strategies.none import NoCache

    model = tiny()
    cache = ReadsStaleSlots(model.config, max_seq_len=CHECKED + 8, dtype=model.dtype, device=model.device)
    ids = torch.tensor([[5 + t for t in range(CHECKED)]], device=model.device)
    with torch.no_grad():
        model(torch.tensor([[300 + t for t in range(EARLIER)]], device=model.device), cache, 0)
        cache.truncate(0)
        reference = model(ids, NoCache(model.config, dtype=model.dtype, device=model.device), 0)[0]
        got = [model(ids[:, :PROMPT], cache, 0)[0]]
        got += [model(ids[:, p:p + 1], cache, p)[0] for p in range(PROMPT, CHECKED)]
    diff = (torch.cat(got) - reference).abs().amax(-1)
    return (diff > 1e-3).nonzero().flatten().tolist()


EXERCISES = [
    Exercise("07.1", "number", "Run the off-by-one write (bug 1: a decode step writes one slot past its position) "
                               "through kvexplore.doctor on the tiny model with a 10-token prompt. At which position "
                               "does the cache first part from the recomputation?"),
    Exercise("07.2", "number", "Bug 3 (stale slots: reads go up to the highest slot ever written) on the tiny model: "
                               "the cache held a 24-token sequence and was rewound to 0 (cache.truncate(0)); then "
                               "check_cache teacher-forces a new 30-token sequence through it, a 10-token prompt and "
                               "one token a step. At how many of the 30 positions do the logits part from the "
                               "recomputation (by more than 1e-3)?", unit="positions"),
]
ANSWERS = {"07.1": _first_position, "07.2": lambda: len(_wrong_positions())}
MISTAKES = {"07.1": [
    (lambda: 0, "the prompt goes through the prefill path, which writes where it should: the prefill agrees."),
    (lambda: PROMPT - 1, "the last prompt position is written by the prefill too, which is right: look at the first "
                         "position a decode step writes."),
    (lambda: PROMPT + 1, "that is the slot the buggy write fills; the doctor names the position whose step reads "
                         "wrong: the token it was given."),
], "07.2": [
    (lambda: EARLIER - 1 - PROMPT, "from position 23 on a step reads exactly its own positions again, but the steps "
                                   "before it wrote keys and values computed from stale reads into layers 1 and up, "
                                   "and they stay in the cache: every later step reads them."),
    (lambda: EARLIER - PROMPT, "the step at position 23 reads 24 slots, positions 0 to 23, all of this sequence: its "
                               "read is not stale. Look instead at what the steps before it left in the cache."),
    (lambda: CHECKED, "the prompt goes in one pass, and its causal mask hides every slot past a query's position: "
                      "the stale slots cannot reach a prompt position."),
    (lambda: 0, "on a fresh cache the bug hides, but this cache held another sequence: its slots past the new "
                "sequence's length are stale, and a decode step has no mask to hide them."),
]}
HINTS = {"07.1": "the prefill path is right and the decode path is not: find the position the first decode step "
                 "computes (positions count from 0).",
         "07.2": "find the first step that reads a stale slot, then ask what it wrote: a wrong output in layer 0 makes "
                 "wrong keys in every layer above it, and later steps read those."}
